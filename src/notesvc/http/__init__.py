"""notesvc.http: see the modules beside this file."""
