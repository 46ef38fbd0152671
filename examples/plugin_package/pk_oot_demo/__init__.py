"""pk-oot-demo: a transport (``counting``) and a monitor plugin (``oot_monitor``)."""
