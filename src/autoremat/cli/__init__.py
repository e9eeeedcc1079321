"""The ``autoremat`` command (:func:`autoremat.cli.commands.main`)."""
