"""Data: readers for the user's files, labelled splits, the tokenizer, the prepared corpus, windows and batches."""
