"""The foundation every layer may use: errors and exit codes, canonical JSON, BLAKE3 hashing, sizes, dtypes,
atomic user files, the per-user runtime, cache and private directories, this host's platform tag, thread pools and
numeric settings.

May import: nothing of qbuild outside this package.
"""
