"""The Tkinter launcher (arrives with its own issue)."""
