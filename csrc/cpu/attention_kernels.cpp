// PLACEHOLDER: per-ISA CPU attention kernels.
