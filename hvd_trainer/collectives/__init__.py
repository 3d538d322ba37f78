"""Collectives: the operations that move data between ranks (ops), and what they use:
fusion, host and device memory, sparse rows, Adasum, error feedback, join, traffic counts."""
