"""notesvc.transfer: see the modules beside this file."""
