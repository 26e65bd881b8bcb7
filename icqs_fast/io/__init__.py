"""Files in and out, with no torch and no argparse: ``records`` (types, errors), ``arrow`` and
``readers`` (JSONL/CSV/TSV, Parquet, datasets folders), ``results`` (JSONL / Parquet writers),
``runs`` (output policy, lock, resume, run metadata) and ``datasets`` (FPB, SST-2, ChaosNLI,
MT-Bench loaders).
"""
