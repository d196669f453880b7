"""A language model: a decoder-only transformer, its token data (byte-level text, pre-tokenized files), callbacks."""
