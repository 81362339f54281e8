/* tkv_fast.c - the fast path's records (proto/tkv_attach.h), shared by tierkvd and
 * libkvclient: one message is sent and received as a run of SEQPACKET records. */
#include "tkv_attach.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/uio.h>



static bool grow(uint8_t **buf, size_t *cap, size_t n, char *why, size_t why_cap)
{
    uint8_t *p = realloc(*buf, n);
    if (!p) {
        snprintf(why, why_cap, "out of memory for a %zu-byte message", n);
        return false;
    }
    *buf = p;
    *cap = n;
    return true;
}

/* Receives one message into *buf (grown as needed, at most max bytes). Returns 1 with *hdr
 * set, 0 on a clean end of the connection, -1 on a malformed message (why in errbuf). */
int tkv_fast_recv(int fd, tkv_fast_hdr *hdr, uint8_t **buf, size_t *cap, size_t max,
                    size_t *len, char *why, size_t why_cap)
{
    size_t got = 0;
    for (bool first = true;; first = false) {
        tkv_fast_hdr h;
        if (first && *cap < TKV_FAST_FRAG_BYTES && !grow(buf, cap, TKV_FAST_FRAG_BYTES, why, why_cap))
            return -1;
        size_t room = *cap - got < TKV_FAST_FRAG_BYTES ? *cap - got : TKV_FAST_FRAG_BYTES;
        struct iovec iov[2] = {{&h, sizeof(h)}, {*buf + got, room}};
        struct msghdr mh = {.msg_iov = iov, .msg_iovlen = 2};
        ssize_t n = recvmsg(fd, &mh, MSG_CMSG_CLOEXEC);
        if (n == 0 || (n < 0 && (errno == ECONNRESET || errno == EPIPE || errno == ESHUTDOWN)))
            return 0;
        if (n < 0) {
            if (errno == EINTR)
                continue;
            snprintf(why, why_cap, "recv: %s", strerror(errno));
            return -1;
        }
        if ((size_t)n < sizeof(h) || (mh.msg_flags & (MSG_TRUNC | MSG_CTRUNC)) ||
            h.magic != TKV_FAST_MAGIC) {
            snprintf(why, why_cap, "malformed record (%zd bytes, magic 0x%08x)", n, h.magic);
            return -1;
        }
        if (first) {
            if (h.len > max) {
                snprintf(why, why_cap, "request of %u bytes exceeds the limit (%zu)", h.len, max);
                return -1;
            }
            *hdr = h;
            if (*cap < h.len && !grow(buf, cap, h.len, why, why_cap))
                return -1;
        } else if (h.len != hdr->len || h.op != hdr->op) {
            snprintf(why, why_cap, "record of another message inside message op %u", hdr->op);
            return -1;
        }
        got += (size_t)n - sizeof(h);
        if (got > hdr->len) {
            snprintf(why, why_cap, "records carry more than the %u bytes announced", hdr->len);
            return -1;
        }
        if (!(h.flags & TKV_FAST_MORE))
            break;
        if (got == hdr->len || h.flags & ~TKV_FAST_MORE) {
            snprintf(why, why_cap, "bad record flags 0x%x", h.flags);
            return -1;
        }
        /* the buffer was grown to h.len above: the next recv's room is what is left */
        if (*cap - got == 0) {
            snprintf(why, why_cap, "records carry more than announced");
            return -1;
        }
    }
    if (got != hdr->len) {
        snprintf(why, why_cap, "message ended after %zu of %u bytes", got, hdr->len);
        return -1;
    }
    *len = got;
    return 1;
}

/* Sends one message as records. Returns false when the peer is gone. */
bool tkv_fast_send(int fd, uint16_t op, uint32_t timeout_ms, int32_t status, const uint8_t *p, size_t len)
{
    size_t off = 0;
    do {
        size_t n = len - off < TKV_FAST_FRAG_BYTES ? len - off : TKV_FAST_FRAG_BYTES;
        tkv_fast_hdr h = {.magic = TKV_FAST_MAGIC, .op = op, .len = (uint32_t)len,
                          .status = status, .timeout_ms = timeout_ms, .flags = off + n < len ? TKV_FAST_MORE : 0};
        struct iovec iov[2] = {{&h, sizeof(h)}, {(void *)(p + off), n}};
        struct msghdr mh = {.msg_iov = iov, .msg_iovlen = 2};
        ssize_t w = sendmsg(fd, &mh, MSG_NOSIGNAL);
        if (w < 0 && errno == EINTR)
            continue;
        if (w != (ssize_t)(sizeof(h) + n))
            return false;
        off += n;
    } while (off < len);
    return true;
}

