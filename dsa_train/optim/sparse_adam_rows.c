/* The SparseAdam row update in two fused passes, for float32 and float64 tables.
 *
 * Compiled once per machine by dsa_train/optim/native.py with -ffp-contract=off, so every
 * operation rounds exactly as torch's element-wise kernels do (no fused multiply-add).
 * Between the passes the caller runs torch.sqrt on new_v: torch's CPU sqrt is not correctly
 * rounded on every build (it is not on the MKL build we test with), and using torch's own
 * keeps the results bit-identical to torch.optim.SparseAdam.
 *
 *   moments pass: g = sum of the row's lookups in coalesce's order
 *                 m += (g - m) * (1 - beta1);  v += (g * g - v) * (1 - beta2)   (in place)
 *                 new_m, new_v = m, v                                         (contiguous)
 *   apply pass:   update = (new_m / (sqrt_v + eps)) * neg_step_size
 *                 param[row] += update, or out[i] = update
 *
 * rows: unique, ascending; starts[i]..starts[i+1]: row i's lookups in order (coalesce's sort);
 * starts/order NULL when the gradient is already coalesced (values[i] belongs to rows[i]).
 * moments + r * record: row r's m, followed by its v (record = 2 * width in an optimizer row
 * file, 3 * width in a disk table, whose records are [w | m | v]).
 */
#include <stdint.h>
#include <string.h>

/* Fault in every page of the bytes first..last (pages of page_bytes) by touching one byte of
 * each: a read, or with claim a write that changes nothing (an atomic OR with zero), which is
 * safe while other threads write the same bytes. A claimed page takes one fault where a read
 * followed by a write takes two on a page not yet in memory (a zero-filled read-only page,
 * then a write-protect fault), and a fresh state file's pages are all like that. Returns the
 * bytes read, so that the reads are not optimised away. */
#define CLAIM_PAGE_BYTES 4096 /* the smallest page: on larger ones this only touches more often */

static inline int64_t touch_pages(char *first, char *last, int64_t page_bytes, int claim)
{
    int64_t sum = 0;
    for (char *p = first; p <= last;) {
        if (claim)
            __atomic_fetch_or(p, 0, __ATOMIC_RELAXED);
        else
            sum += *(volatile char *)p;
        p = (char *)(((uintptr_t)p / page_bytes + 1) * page_bytes);
    }
    return sum;
}

/* Rows to prefetch ahead: enough to keep several DRAM misses in flight. */
#define AHEAD 6

#define DEFINE_MOMENTS(NAME, T)                                                             \
void NAME(T *moments, const int64_t *rows, const int64_t *starts, const int64_t *order,     \
          const T *values, int64_t begin, int64_t end, int64_t width, int64_t record,       \
          T one_minus_beta1, T one_minus_beta2, int maximize, T *new_m, T *new_v)           \
{                                                                                           \
    for (int64_t i = begin; i < end; ++i) {                                                 \
        if (i + AHEAD < end) {                                                              \
            const char *next = (const char *)(moments + rows[i + AHEAD] * record);          \
            for (int64_t b = 0; b < (int64_t)(2 * width * sizeof(T)); b += 64)              \
                __builtin_prefetch(next + b, 1, 0);                                         \
        }                                                                                   \
        T *m = moments + rows[i] * record;                                                  \
        T *v = m + width;                                                                   \
        touch_pages((char *)m, (char *)(v + width) - 1, CLAIM_PAGE_BYTES, 1);               \
        T *nm = new_m + (i - begin) * width;                                                \
        T *nv = new_v + (i - begin) * width;                                                \
        const T *g = values + (order ? order[starts[i]] : i) * width;                       \
        if (starts && starts[i + 1] - starts[i] > 1) {                                      \
            memcpy(nv, g, width * sizeof(T)); /* nv is scratch until the loop below */      \
            for (int64_t s = starts[i] + 1; s < starts[i + 1]; ++s) {                       \
                const T *extra = values + order[s] * width;                                 \
                for (int64_t j = 0; j < width; ++j) nv[j] = nv[j] + extra[j];               \
            }                                                                               \
            g = nv;                                                                         \
        }                                                                                   \
        for (int64_t j = 0; j < width; ++j) {                                               \
            const T gj = g[j];                                                              \
            T dm = maximize ? -(gj + m[j]) : gj - m[j];                                     \
            dm = dm * one_minus_beta1;                                                      \
            const T mn = m[j] + dm;                                                         \
            T dv = gj * gj;                                                                 \
            dv = dv - v[j];                                                                 \
            dv = dv * one_minus_beta2;                                                      \
            const T vn = v[j] + dv;                                                         \
            m[j] = mn;                                                                      \
            v[j] = vn;                                                                      \
            nm[j] = mn;                                                                     \
            nv[j] = vn;                                                                     \
        }                                                                                   \
    }                                                                                       \
}

#define DEFINE_APPLY(NAME, T)                                                               \
void NAME(T *param, int64_t param_row_stride, T *out, const int64_t *rows,                  \
          int64_t begin, int64_t end, int64_t width, const T *new_m, const T *sqrt_v,       \
          T eps, T neg_step_size)                                                           \
{                                                                                           \
    for (int64_t i = begin; i < end; ++i) {                                                 \
        if (param && i + AHEAD < end) {                                                     \
            const char *np = (const char *)(param + rows[i + AHEAD] * param_row_stride);    \
            for (int64_t b = 0; b < (int64_t)(width * sizeof(T)); b += 64)                  \
                __builtin_prefetch(np + b, 1, 0);                                           \
        }                                                                                   \
        const T *nm = new_m + (i - begin) * width;                                          \
        const T *sv = sqrt_v + (i - begin) * width;                                         \
        if (param) {                                                                        \
            T *p = param + rows[i] * param_row_stride;                                      \
            for (int64_t j = 0; j < width; ++j)                                             \
                p[j] = p[j] + (nm[j] / (sv[j] + eps)) * neg_step_size;                      \
        } else {                                                                            \
            T *u = out + i * width;                                                         \
            for (int64_t j = 0; j < width; ++j)                                             \
                u[j] = (nm[j] / (sv[j] + eps)) * neg_step_size;                             \
        }                                                                                   \
    }                                                                                       \
}

DEFINE_MOMENTS(dsa_moments_f32, float)
DEFINE_MOMENTS(dsa_moments_f64, double)
DEFINE_APPLY(dsa_apply_f32, float)
DEFINE_APPLY(dsa_apply_f64, double)

/* Page in the records of rows[0..n) of a mapping (row r's record: record_bytes at
 * base + r * record_stride), touching every page they span once (see touch_pages). A
 * prefetch thread calls it for the next step's rows; it runs no torch operation, so it never
 * starts a thread team of its own. */
int64_t dsa_touch_rows(char *base, const int64_t *rows, int64_t n, int64_t record_stride,
                       int64_t record_bytes, int64_t page_bytes, int claim)
{
    int64_t sum = 0;
    for (int64_t i = 0; i < n; ++i) {
        char *first = base + rows[i] * record_stride;
        sum += touch_pages(first, first + record_bytes - 1, page_bytes, claim);
    }
    return sum;
}
