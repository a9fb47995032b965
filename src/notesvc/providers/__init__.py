"""notesvc.providers: see the modules beside this file."""
