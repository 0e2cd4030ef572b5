"""Ground-floor helpers every package may use: Hugging Face Hub resolution, progress of long commands."""
