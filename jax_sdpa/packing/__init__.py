"""Packed documents (segment ids) at the cost of their tokens: documents.py (the ids as a
document table, on the device), grids.py (the ragged grids a checked call chooses among),
ragged.py (the packed call on cuDNN's ragged layout) and fallback.py (ids the table cannot
hold: one dense cuDNN call masking them)."""
