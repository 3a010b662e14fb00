/*
 * How long one turn of a spin-wait takes on this CPU: the pause hint (x86) or yield (ARM) that
 * GNU OpenMP's threads run between two looks at a flag they wait on. GOMP_SPINCOUNT counts such
 * turns, and their length differs by a factor of several between CPUs, so an engine process turns
 * the time it wants its threads to spin into a count with this (engine.allocator).
 */
#include <stdint.h>
#include <time.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define SPIN_TURN() _mm_pause()
#elif defined(__aarch64__)
#define SPIN_TURN() __asm__ __volatile__("yield" ::: "memory")
#else
#define SPIN_TURN() __asm__ __volatile__("" ::: "memory")
#endif

static double now_s(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

/* Seconds per turn: the fastest of `rounds` runs of `turns` turns each (another process taking the
 * core only ever lengthens a run). */
double spin_turn_seconds(int64_t turns, int rounds) {
    double best = 1e9;
    for (int r = 0; r < rounds; r++) {
        const double start = now_s();
        for (int64_t i = 0; i < turns; i++) SPIN_TURN();
        const double t = (now_s() - start) / (double)(turns > 0 ? turns : 1);
        if (t < best) best = t;
    }
    return best;
}
