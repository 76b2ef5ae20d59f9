"""The paged KV pool: fixed-size pages shared by all sequences (host bookkeeping in pages.py,
device-side writes, reads and attention over a sequence's own pages in paged.py)."""
