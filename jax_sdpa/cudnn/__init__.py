"""Our XLA FFI targets on cuDNN: targets.py declares them (one per job and direction, each with
its operands and attributes; the C++ handlers are generated from it), call.py is the one place
a CallSpec becomes an FFI call, and dense.py, ragged.py, paged.py and fp8.py are each job's
call; extension.py loads the C++ extension and registers the targets."""
