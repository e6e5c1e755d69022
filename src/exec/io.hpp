// How many threads the executors use for I/O by default.
#pragma once


namespace shardmerge {

// Threads that read, cast and write when --threads is not given: two per core this process may
// run on. A merge whose checkpoint is not cached waits on the disk, and the second thread of a
// core keeps a read in flight while the first casts (7B shape, 30 GB not cached, 2 cores:
// 41-49 s with 4 threads, 45-49 s with 2, 49-51 s with 8).
unsigned default_io_threads();
// The cores this process may run on (its affinity mask), and those the machine has.
unsigned usable_cores();

}  // namespace shardmerge
