"""A task's barrier handling as explicit states (``states.py``), driven by one
handler (``handler.py``) that acts on the task only through ``controller.py``."""
