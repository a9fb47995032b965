"""notesvc.search: see the modules beside this file."""
