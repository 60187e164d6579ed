/* The cheap ends of benchmarks/workers_scaling.py: a paced SSE upstream and a closed-loop
 * HTTP/1.1 client, single-threaded epoll, a few syscalls per event, so that the relay between
 * them (the sidecar) is what runs out of CPU. Built by the harness with `cc -O2`.
 *
 *   load upstream PORT UNITS_FILE STEP_US
 *     Serves every request (any method, any path, body read by Content-Length) with the same
 *     answer: the units of UNITS_FILE (u32 count, then per unit u32 length + bytes), unit 0 (the
 *     response head and the role chunk) at once, then one unit per tick of a STEP_US timer to
 *     every stream in progress, as an engine step gives one token to every sequence of its batch.
 *     One write per unit: the relay gets one event per read unless it falls behind.
 *   load client HOST PORT CONNS REQUEST_FILE
 *     CONNS keep-alive connections, each sending REQUEST_FILE's bytes (a whole HTTP/1.1
 *     request) again as soon as the previous answer ended (closed loop). Counts answers, SSE
 *     events (each "\n\n"), token events (each "\"delta\":{\"content\":\""), reads and bytes.
 *     SIGUSR1 prints a line "snap MONOTONIC_NS answers events tokens reads bytes errors";
 *     SIGTERM prints it once more and exits.
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/epoll.h>
#include <sys/signalfd.h>
#include <sys/socket.h>
#include <sys/timerfd.h>
#include <time.h>
#include <unistd.h>

#define MAXFD 65536
#define INBUF 65536

static void die(const char *what) {
    perror(what);
    exit(1);
}

static char *slurp(const char *path, size_t *len) {
    FILE *f = fopen(path, "rb");
    if (!f) die(path);
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *buf = malloc((size_t)n + 1);
    if (!buf || fread(buf, 1, (size_t)n, f) != (size_t)n) die("read");
    fclose(f);
    *len = (size_t)n;
    return buf;
}

static void nonblock(int fd) { fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) | O_NONBLOCK); }

static void nodelay(int fd) {
    int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
}

static uint64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

/* ----------------------------------------------------------------------------- upstream */

static char **unit;
static uint32_t *unit_len;
static uint32_t n_units;

struct sconn {
    int fd, streaming;
    uint32_t next;          /* next unit to write */
    const char *pend;       /* rest of a unit a full socket did not take */
    size_t pend_len;
    char in[INBUF];
    size_t in_len;
};

static struct sconn *sconns[MAXFD];
static int active[MAXFD];
static int n_active;

/* Close a connection: out of the epoll set, out of the active list, freed. */
static void sclose(int ep, struct sconn *c) {
    if (c->streaming)
        for (int k = 0; k < n_active; k++)
            if (active[k] == c->fd) {
                active[k] = active[--n_active];
                break;
            }
    epoll_ctl(ep, EPOLL_CTL_DEL, c->fd, NULL);
    close(c->fd);
    sconns[c->fd] = NULL;
    free(c);
}

/* Write unit bytes; 0 when all went (or are pending), -1 when the connection failed. */
static int swrite(struct sconn *c, const char *p, size_t n) {
    ssize_t w = write(c->fd, p, n);
    if (w < 0) {
        if (errno != EAGAIN) return -1;
        w = 0;
    }
    c->pend = p + w;
    c->pend_len = n - (size_t)w;
    return 0;
}

/* A whole request in c->in? Start its answer. */
static int maybe_start(struct sconn *c) {
    if (c->streaming) return 0;
    char *end = memmem(c->in, c->in_len, "\r\n\r\n", 4);
    if (!end) return 0;
    size_t head = (size_t)(end - c->in) + 4;
    size_t body = 0;
    for (char *p = c->in; p < end; p++) {
        if ((p == c->in || p[-1] == '\n') && strncasecmp(p, "content-length:", 15) == 0) {
            body = strtoul(p + 15, NULL, 10);
            break;
        }
    }
    if (c->in_len < head + body) return 0;
    memmove(c->in, c->in + head + body, c->in_len - head - body);
    c->in_len -= head + body;
    c->streaming = 1;
    c->next = 1;
    active[n_active++] = c->fd;
    return swrite(c, unit[0], unit_len[0]);
}

static int run_upstream(int argc, char **argv) {
    if (argc != 5) {
        fprintf(stderr, "usage: load upstream PORT UNITS_FILE STEP_US\n");
        return 2;
    }
    int port = atoi(argv[2]);
    size_t flen;
    char *file = slurp(argv[3], &flen);
    long step_us = atol(argv[4]);
    memcpy(&n_units, file, 4);
    unit = calloc(n_units, sizeof *unit);
    unit_len = calloc(n_units, sizeof *unit_len);
    size_t off = 4;
    for (uint32_t i = 0; i < n_units; i++) {
        memcpy(&unit_len[i], file + off, 4);
        unit[i] = file + off + 4;
        off += 4 + unit_len[i];
    }
    signal(SIGPIPE, SIG_IGN);
    int ls = socket(AF_INET, SOCK_STREAM, 0);
    int one = 1;
    setsockopt(ls, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (bind(ls, (struct sockaddr *)&a, sizeof a) < 0) die("bind");
    if (listen(ls, 4096) < 0) die("listen");
    nonblock(ls);
    int ep = epoll_create1(0);
    struct epoll_event ev = {.events = EPOLLIN, .data.fd = ls};
    epoll_ctl(ep, EPOLL_CTL_ADD, ls, &ev);
    int tfd = timerfd_create(CLOCK_MONOTONIC, TFD_NONBLOCK);
    struct itimerspec its = {{step_us / 1000000, (step_us % 1000000) * 1000},
                             {step_us / 1000000, (step_us % 1000000) * 1000}};
    timerfd_settime(tfd, 0, &its, NULL);
    ev.data.fd = tfd;
    epoll_ctl(ep, EPOLL_CTL_ADD, tfd, &ev);
    struct epoll_event evs[256];
    for (;;) {
        int n = epoll_wait(ep, evs, 256, -1);
        if (n < 0 && errno != EINTR) die("epoll_wait");
        for (int i = 0; i < n; i++) {
            int fd = evs[i].data.fd;
            if (fd == ls) {
                int cfd;
                while ((cfd = accept4(ls, NULL, NULL, SOCK_NONBLOCK)) >= 0) {
                    if (cfd >= MAXFD) {
                        close(cfd);
                        continue;
                    }
                    nodelay(cfd);
                    struct sconn *c = calloc(1, sizeof *c);
                    c->fd = cfd;
                    sconns[cfd] = c;
                    struct epoll_event e = {.events = EPOLLIN, .data.fd = cfd};
                    epoll_ctl(ep, EPOLL_CTL_ADD, cfd, &e);
                }
            } else if (fd == tfd) {
                uint64_t ticks;
                if (read(tfd, &ticks, sizeof ticks) < 0) continue;
                static int done[MAXFD];
                int kept = 0, n_done = 0, n_was = n_active;
                for (int k = 0; k < n_was; k++) {
                    struct sconn *c = sconns[active[k]];
                    int rc;
                    if (c->pend_len) {
                        rc = swrite(c, c->pend, c->pend_len);
                    } else {
                        rc = swrite(c, unit[c->next], unit_len[c->next]);
                        c->next++;
                    }
                    if (rc < 0 || (c->next >= n_units && c->pend_len == 0)) {
                        c->streaming = 0;
                        done[n_done++] = rc < 0 ? -c->fd - 1 : c->fd;
                        continue;
                    }
                    active[kept++] = c->fd;
                }
                n_active = kept;
                for (int k = 0; k < n_done; k++) {
                    int dfd = done[k] < 0 ? -done[k] - 1 : done[k];
                    struct sconn *c = sconns[dfd];
                    if (done[k] < 0 || maybe_start(c) < 0) sclose(ep, c);
                }
            } else {
                struct sconn *c = sconns[fd];
                if (!c) continue;
                ssize_t r = read(fd, c->in + c->in_len, INBUF - c->in_len);
                if (r <= 0) {
                    if (r < 0 && errno == EAGAIN) continue;
                    sclose(ep, c);
                    continue;
                }
                c->in_len += (size_t)r;
                if (maybe_start(c) < 0) sclose(ep, c);
            }
        }
    }
}

/* ----------------------------------------------------------------------------- client */

static const char *req;
static size_t req_len;
static struct sockaddr_in target;
static uint64_t answers, events, tokens, reads, bytes, errors;

struct cconn {
    int fd, in_body;
    char prev;              /* last byte seen, for "\n\n" across reads */
    char tail[32];          /* last bytes of the answer so far */
    size_t tail_len;
    char head[4096];
    size_t head_len;
};

static const char TOKEN[] = "\"delta\":{\"content\":\"";
static const char END[] = "[DONE]\n\n\r\n0\r\n\r\n";

static int cconnect(int ep, struct cconn *c) {
    c->fd = socket(AF_INET, SOCK_STREAM, 0);
    if (c->fd < 0) return -1;
    if (connect(c->fd, (struct sockaddr *)&target, sizeof target) < 0) {
        close(c->fd);
        return -1;
    }
    nodelay(c->fd);
    nonblock(c->fd);
    struct epoll_event e = {.events = EPOLLIN, .data.ptr = c};
    epoll_ctl(ep, EPOLL_CTL_ADD, c->fd, &e);
    return 0;
}

static void csend(struct cconn *c) {
    c->in_body = 0;
    c->prev = 0;
    c->tail_len = 0;
    c->head_len = 0;
    if (write(c->fd, req, req_len) != (ssize_t)req_len) errors++; /* small: goes whole */
}

static void creconnect(int ep, struct cconn *c) {
    epoll_ctl(ep, EPOLL_CTL_DEL, c->fd, NULL);
    close(c->fd);
    while (cconnect(ep, c) < 0) usleep(10000);
    csend(c);
}

static void body_bytes(struct cconn *c, const char *p, size_t n) {
    for (const char *q = p; (q = memchr(q, '\n', (size_t)(p + n - q))) != NULL; q++) {
        char before = q == p ? c->prev : q[-1];
        if (before == '\n') events++;
    }
    for (const char *q = p; (q = memmem(q, (size_t)(p + n - q), TOKEN, sizeof TOKEN - 1));
         q++)
        tokens++;
    if (n) c->prev = p[n - 1];
    if (n >= sizeof c->tail) {
        memcpy(c->tail, p + n - sizeof c->tail, sizeof c->tail);
        c->tail_len = sizeof c->tail;
    } else {
        size_t keep = c->tail_len + n > sizeof c->tail ? sizeof c->tail - n : c->tail_len;
        memmove(c->tail, c->tail + c->tail_len - keep, keep);
        memcpy(c->tail + keep, p, n);
        c->tail_len = keep + n;
    }
}

static int answer_ended(struct cconn *c) {
    size_t e = sizeof END - 1;
    return c->tail_len >= e && memcmp(c->tail + c->tail_len - e, END, e) == 0;
}

static void snap(const char *tag) {
    printf("%s %llu %llu %llu %llu %llu %llu %llu\n", tag, (unsigned long long)now_ns(),
           (unsigned long long)answers, (unsigned long long)events, (unsigned long long)tokens,
           (unsigned long long)reads, (unsigned long long)bytes, (unsigned long long)errors);
    fflush(stdout);
}

static int run_client(int argc, char **argv) {
    if (argc != 6) {
        fprintf(stderr, "usage: load client HOST PORT CONNS REQUEST_FILE\n");
        return 2;
    }
    target.sin_family = AF_INET;
    target.sin_port = htons((uint16_t)atoi(argv[3]));
    if (inet_pton(AF_INET, argv[2], &target.sin_addr) != 1) die("host");
    int conns = atoi(argv[4]);
    req = slurp(argv[5], &req_len);
    signal(SIGPIPE, SIG_IGN);
    sigset_t mask;
    sigemptyset(&mask);
    sigaddset(&mask, SIGUSR1);
    sigaddset(&mask, SIGTERM);
    sigaddset(&mask, SIGINT);
    sigprocmask(SIG_BLOCK, &mask, NULL);
    int sfd = signalfd(-1, &mask, SFD_NONBLOCK);
    int ep = epoll_create1(0);
    struct epoll_event sev = {.events = EPOLLIN, .data.ptr = NULL};
    epoll_ctl(ep, EPOLL_CTL_ADD, sfd, &sev);
    struct cconn *cs = calloc((size_t)conns, sizeof *cs);
    for (int i = 0; i < conns; i++) {
        if (cconnect(ep, &cs[i]) < 0) die("connect");
        csend(&cs[i]);
    }
    static char buf[1 << 18];
    struct epoll_event evs[256];
    for (;;) {
        int n = epoll_wait(ep, evs, 256, -1);
        if (n < 0 && errno != EINTR) die("epoll_wait");
        for (int i = 0; i < n; i++) {
            struct cconn *c = evs[i].data.ptr;
            if (c == NULL) {
                struct signalfd_siginfo si;
                while (read(sfd, &si, sizeof si) == sizeof si) {
                    if (si.ssi_signo == SIGUSR1) {
                        snap("snap");
                    } else {
                        snap("final");
                        return 0;
                    }
                }
                continue;
            }
            ssize_t r = read(c->fd, buf, sizeof buf);
            if (r < 0 && errno == EAGAIN) continue;
            if (r <= 0) { /* the relay closed: count it unless between answers */
                if (c->in_body || c->head_len) errors++;
                creconnect(ep, c);
                continue;
            }
            reads++;
            bytes += (uint64_t)r;
            const char *p = buf;
            size_t len = (size_t)r;
            if (!c->in_body) {
                size_t take = len < sizeof c->head - c->head_len ? len : sizeof c->head - c->head_len;
                memcpy(c->head + c->head_len, p, take);
                c->head_len += take;
                char *end = memmem(c->head, c->head_len, "\r\n\r\n", 4);
                if (!end) {
                    if (c->head_len == sizeof c->head) {
                        errors++;
                        creconnect(ep, c);
                    }
                    continue;
                }
                if (strncmp(c->head, "HTTP/1.1 200", 12) != 0) {
                    errors++;
                    creconnect(ep, c);
                    continue;
                }
                size_t used = (size_t)(end + 4 - c->head) - (c->head_len - take);
                p += used;
                len -= used;
                c->in_body = 1;
            }
            body_bytes(c, p, len);
            if (answer_ended(c)) {
                answers++;
                csend(c);
            }
        }
    }
}

int main(int argc, char **argv) {
    if (argc >= 2 && strcmp(argv[1], "upstream") == 0) return run_upstream(argc, argv);
    if (argc >= 2 && strcmp(argv[1], "client") == 0) return run_client(argc, argv);
    fprintf(stderr, "usage: load upstream ... | load client ...\n");
    return 2;
}
