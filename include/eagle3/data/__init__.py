"""Conversations into samples (token ids, loss masks), samples into the hidden-state store, and their identity
(the keys of shared stores and answer caches) and the public evaluation sets."""
