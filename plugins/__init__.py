"""rlite's built-in plugins. Each module is registered through the same pluggy path as a
third-party plugin (see ``rlite.plugin_manager.DEFAULT_PLUGINS``)."""
