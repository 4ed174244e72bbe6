/*
 * The flags tensor-parallel ranks of one host signal each other with through shared memory
 * (engine/tensor_parallel/shared_memory_collectives.py): each rank owns one 64-bit counter,
 * raised with release order after it has written its part of a collective, and a rank waits
 * with acquire loads until every counter has reached the collective's number, so the parts
 * it then reads are complete on any CPU's memory model.
 */
#include <sched.h>
#include <stdint.h>
#include <time.h>

/* Spins before each sched_yield: long enough to catch a peer on its own core within
   microseconds, short enough that ranks sharing a core hand it over. */
#define RANK_FLAGS_SPINS 4096

void rank_flag_raise(int64_t *flag, int64_t value) { __atomic_store_n(flag, value, __ATOMIC_RELEASE); }

static int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

/*
 * Wait until flags[k * stride] >= value for every k < num_ranks (stride in 64-bit words), or
 * *abort is non-zero, or timeout_ns have passed. Returns 0 when every flag arrived, 1 on
 * abort, 2 on timeout (the caller checks its peers are alive and waits again, or gives up).
 */
int rank_flags_wait(const int64_t *flags, int64_t stride, int64_t num_ranks, int64_t value, const int64_t *abort,
                    int64_t timeout_ns) {
    int64_t deadline = now_ns() + timeout_ns;
    int64_t next = 0; /* the first rank not yet seen to arrive */
    for (;;) {
        for (int spin = 0; spin < RANK_FLAGS_SPINS; spin++) {
            while (next < num_ranks && __atomic_load_n(&flags[next * stride], __ATOMIC_ACQUIRE) >= value) next++;
            if (next == num_ranks) return 0;
            if (__atomic_load_n(abort, __ATOMIC_ACQUIRE)) return 1;
        }
        if (now_ns() >= deadline) return 2;
        sched_yield();
    }
}
