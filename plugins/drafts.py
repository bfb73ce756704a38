"""Built-in speculative-decoding drafts.

rlite registers no draft of its own yet: ``rollout.draft: none`` (the default) runs plain decoding.
Drafts are engine-specific (SGLang EAGLE/NGRAM); a plugin registers one through
``register_speculative_drafts``.
"""
