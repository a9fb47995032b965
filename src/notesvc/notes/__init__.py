"""notesvc.notes: see the modules beside this file."""
