"""What ``patches/miles_table.py`` names for a miles-diffusion checkout (imported only by import string)."""
