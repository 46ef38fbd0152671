"""The plugin machinery: hookspecs (the contract), the plugin manager, the built-in plugin, hook docs, inventory."""
