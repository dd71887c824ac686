// Exceptions of the block manager. bindings.cpp maps each one to a Python
// class of the same name, all deriving from pagedkv.core.BlockManagerError.
#pragma once

#include <stdexcept>
#include <string>

namespace pagedkv {

// Base of every block-manager error.
struct BlockManagerError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// The pool has too few free blocks. A normal condition: the scheduler catches
// it (or asks can_allocate / can_append first) and preempts or waits.
struct NoFreeBlocksError : BlockManagerError {
  using BlockManagerError::BlockManagerError;
};

// A sequence id that the manager does not hold (Python: also a KeyError).
struct UnknownSequenceError : BlockManagerError {
  using BlockManagerError::BlockManagerError;
};

// allocate / fork onto a sequence id that already exists (Python: also a ValueError).
struct SequenceExistsError : BlockManagerError {
  using BlockManagerError::BlockManagerError;
};

// A block used against its reference count: double free, freeing a block
// that is still shared, sharing a block that is free (Python: also a ValueError).
struct BlockRefCountError : BlockManagerError {
  using BlockManagerError::BlockManagerError;
};

// An operation that does not fit the sequence's state, e.g. appending to a
// swapped-out sequence (Python: also a ValueError).
struct InvalidSequenceStateError : BlockManagerError {
  using BlockManagerError::BlockManagerError;
};

}  // namespace pagedkv
