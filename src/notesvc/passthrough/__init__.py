"""notesvc.passthrough: see the modules beside this file."""
