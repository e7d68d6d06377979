"""What ``patches/cosmos_table.py`` names for a cosmos-framework checkout (imported only by import string)."""
