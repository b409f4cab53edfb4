/* A few helper threads that share the jobs of one call with the calling thread, and a caller
   that never waits for a helper that has not started: the table-parallel calls
   (fused_tables.pyx) run their tables through es_run.

   An OpenMP team joins at the end of each parallel region: the caller waits until every
   thread of the team has checked in, even one that took no job. On a machine where other
   processes hold the cores the OS may leave a woken thread aside for milliseconds, and each
   region then costs the caller that long (2-thread steps 30-60x slower than 1-thread ones,
   docs/performance-fused.md). Here the caller claims jobs one at a time from a shared
   counter, as each helper does once it runs; when no job is left the task closes, and the
   caller waits only for helpers that joined it (those are running a job they claimed). A
   helper that wakes late finds the task closed and sleeps again. Which thread runs a job
   never changes its bits: each job is one table, run as on one thread.

   Helpers sleep on a condition variable (no spinning: on a shared machine a spinning thread
   takes the core the caller needs), start on first use and live as long as the process. A
   forked child starts its own (the parent's do not exist there). */
#ifndef ES_RUNNER_H
#define ES_RUNNER_H

#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

typedef void (*es_job_fn)(void* job);

#define ES_RUNNER_MAX 64

typedef struct {
    pthread_mutex_t mu;
    pthread_cond_t wake;   /* a task opened */
    pthread_cond_t done;   /* the last helper of a task left it */
    char* jobs;
    size_t size;
    long n;
    es_job_fn fn;
    long next;             /* the next job to claim (atomic) */
    unsigned long gen;     /* the task's number */
    int open;              /* helpers may join */
    int joined, limit;     /* helpers in the task, and how many may join */
    int helpers;           /* helper threads started */
    pid_t pid;
} es_runner;

static es_runner* es_runner_now = NULL;

static void es_claim(es_runner* r) {
    long i;
    while ((i = __atomic_fetch_add(&r->next, 1, __ATOMIC_ACQ_REL)) < r->n)
        r->fn(r->jobs + (size_t) i * r->size);
}

static void* es_helper(void* arg) {
    es_runner* r = (es_runner*) arg;
    unsigned long seen = 0;
    pthread_mutex_lock(&r->mu);
    for (;;) {
        while (!r->open || r->gen == seen || r->joined >= r->limit)
            pthread_cond_wait(&r->wake, &r->mu);
        seen = r->gen;
        r->joined++;
        pthread_mutex_unlock(&r->mu);
        es_claim(r);
        pthread_mutex_lock(&r->mu);
        if (--r->joined == 0 && !r->open)
            pthread_cond_signal(&r->done);
    }
    return NULL;
}

/* The runner of this process (a new one in a forked child: the old one's helpers and its
   locks' state belong to the parent), with at least `helpers` helpers where threads can
   be started; NULL without memory. */
static es_runner* es_runner_get(int helpers) {
    es_runner* r = es_runner_now;
    pthread_t t;
    pthread_attr_t attr;
    if (r == NULL || r->pid != getpid()) {  /* (a child's copy is left as it is) */
        r = (es_runner*) calloc(1, sizeof(es_runner));
        if (r == NULL)
            return NULL;
        pthread_mutex_init(&r->mu, NULL);
        pthread_cond_init(&r->wake, NULL);
        pthread_cond_init(&r->done, NULL);
        r->pid = getpid();
        es_runner_now = r;
    }
    if (helpers > ES_RUNNER_MAX)
        helpers = ES_RUNNER_MAX;
    if (r->helpers < helpers) {
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        pthread_attr_setstacksize(&attr, 1 << 20);
        while (r->helpers < helpers && pthread_create(&t, &attr, es_helper, r) == 0)
            r->helpers++;
        pthread_attr_destroy(&attr);
    }
    return r;
}

/* Whether a call is in the runner (one at a time: a second thread's call meanwhile runs its
   jobs on its own thread rather than wait; a child forked during a call keeps running its
   calls on one thread). */
static int es_runner_busy = 0;

/* `fn` on each of the `n` jobs (`size` bytes apart), shared by this thread and up to
   `threads - 1` helpers; returns when every job is done. */
static void es_run(char* jobs, size_t size, long n, int threads, es_job_fn fn) {
    es_runner* r = NULL;
    long i;
    int idle = 0;
    if (threads > n)
        threads = (int) n;
    if (threads > 1 && __atomic_compare_exchange_n(&es_runner_busy, &idle, 1, 0,
                                                   __ATOMIC_ACQUIRE, __ATOMIC_RELAXED)) {
        r = es_runner_get(threads - 1);
        if (r == NULL || r->helpers == 0) {  /* (no helper could start) */
            __atomic_store_n(&es_runner_busy, 0, __ATOMIC_RELEASE);
            r = NULL;
        }
    }
    if (r == NULL) {
        for (i = 0; i < n; i++)
            fn(jobs + (size_t) i * size);
        return;
    }
    pthread_mutex_lock(&r->mu);
    r->jobs = jobs;
    r->size = size;
    r->n = n;
    r->fn = fn;
    __atomic_store_n(&r->next, 0, __ATOMIC_RELEASE);
    r->gen++;
    r->open = 1;
    r->limit = threads - 1;
    pthread_cond_broadcast(&r->wake);
    pthread_mutex_unlock(&r->mu);
    es_claim(r);
    pthread_mutex_lock(&r->mu);
    r->open = 0;  /* no helper joins from here; those in it finish the jobs they hold */
    while (r->joined > 0)
        pthread_cond_wait(&r->done, &r->mu);
    pthread_mutex_unlock(&r->mu);
    __atomic_store_n(&es_runner_busy, 0, __ATOMIC_RELEASE);
}

#endif
