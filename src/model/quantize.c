/* qf_quantize_dir: a plan of output tensors from the input's names and shapes, then each shard
 * written in one pass, its tensors converted in row chunks spread over the pool. */
#include "model/quantize.h"

#include <dirent.h>
#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "base/dtype.h"
#include "base/err.h"
#include "base/numeric.h"
#include "base/quant.h"
#include "format/config.h"
#include "format/safetensors.h"
#include "format/sha256.h"
#include "format/st_write.h"
#include "backend/ops.h"

enum { J_COPY, J_CONVERT, J_SCALES }; /* bytes as they are; rows converted to fmt; the fp8 job before's scales */
#define CHUNK_BYTES (32u << 20)         /* input bytes a chunk reads at most (whole 128-row bands) */

typedef struct job {
    char *name;
    int kind, fmt;            /* fmt: the output dtype (J_CONVERT) */
    const qf_st_tensor *src;  /* input tensor */
    float *src_scales;        /* an FP8 input's scales as fp32 (owned) */
    int64_t row0, rows, cols; /* rows of the input seen as [rows][cols] (3-D flattened) */
    int ndim;
    int64_t shape[QF_ST_MAX_DIMS];
    uint64_t nbytes;
    float *scales; /* J_CONVERT to fp8: its block scales, which the next (J_SCALES) job writes */
    int shard;
} job;

typedef struct plan {
    const qf_quantize_opts *o;
    qf_st_set st;
    job *jobs;
    int n, cap, n_shards;
    uint64_t done, total;
} plan;

static int ends_with(const char *s, const char *t) {
    size_t a = strlen(s), b = strlen(t);
    return a >= b && !strcmp(s + a - b, t);
}

/* Which weights take the experts' format and which the trunk's. */
static int is_expert(const char *n) {
    return strncmp(n, "mtp.", 4) && strstr(n, ".mlp.experts.") &&
           (ends_with(n, "_proj.weight") || ends_with(n, "experts.gate_up_proj") || ends_with(n, "experts.down_proj"));
}
/* The trunk's large projections (quantize.h: qf_quant_trunk_format says what each becomes). */
static int is_trunk(const char *n) {
    static const char *k[] = {"self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight",
                              "linear_attn.in_proj_qkv.weight", "linear_attn.in_proj_z.weight", "linear_attn.out_proj.weight",
                              "mlp.shared_expert.gate_proj.weight", "mlp.shared_expert.up_proj.weight", "mlp.shared_expert.down_proj.weight"};
    for (size_t i = 0; strncmp(n, "mtp.", 4) && i < sizeof k / sizeof *k; i++)
        if (ends_with(n, k[i])) return 1;
    return 0;
}

/* The small matrices that join the large ones in the device's fused decode products: DeltaNet's
 * in_proj_b / in_proj_a (beside in_proj_qkv / z), the router and the shared expert's gate logit
 * (beside its gate / up). */
static int joins_fused(const char *n) {
    static const char *k[] = {"linear_attn.in_proj_b.weight", "linear_attn.in_proj_a.weight", "mlp.gate.weight", "mlp.shared_expert_gate.weight"};
    for (size_t i = 0; strncmp(n, "mtp.", 4) && i < sizeof k / sizeof *k; i++)
        if (ends_with(n, k[i])) return 1;
    return 0;
}

int qf_quant_trunk_format(const char *name, int trunk) {
    if (trunk == QF_DT_BF16) return is_trunk(name) ? QF_DT_BF16 : 0;
    if (trunk != QF_Q_I8B32) return 0;
    if (ends_with(name, "mlp.shared_expert.down_proj.weight")) return strncmp(name, "mtp.", 4) ? QF_DT_BF16 : 0;
    return is_trunk(name) || joins_fused(name) ? QF_Q_I8B32 : 0;
}

static job *add(plan *p, const char *name, int kind, const qf_st_tensor *src) {
    if (p->n == p->cap) {
        int cap = p->cap ? 2 * p->cap : 256;
        job *j = realloc(p->jobs, (size_t)cap * sizeof *j);
        if (!j) return NULL;
        p->jobs = j, p->cap = cap;
    }
    job *j = &p->jobs[p->n];
    memset(j, 0, sizeof *j);
    if (!(j->name = strdup(name))) return NULL;
    p->n++;
    j->kind = kind, j->src = src;
    j->ndim = src->ndim;
    for (int d = 0; d < src->ndim; d++) j->shape[d] = src->shape[d];
    j->nbytes = src->nbytes;
    j->cols = src->ndim ? src->shape[src->ndim - 1] : 1;
    j->rows = j->cols ? src->n_elem / j->cols : 0;
    return j;
}

/* An FP8 input's `_scale_inv` as fp32. */
static int read_scales(plan *p, const qf_st_tensor *w, float **out) {
    char sn[1024];
    snprintf(sn, sizeof sn, "%s_scale_inv", w->name);
    const qf_st_tensor *s = qf_st_find(&p->st, sn);
    int64_t br = (w->shape[0] + 127) / 128, bc = (w->shape[1] + 127) / 128;
    if (w->ndim != 2 || !s || s->ndim != 2 || s->shape[0] != br || s->shape[1] != bc || (s->dtype != QF_DT_BF16 && s->dtype != QF_DT_F32))
        return qf_fail(QF_EFORMAT, "tensor '%s': F8_E4M3 without a [%lld, %lld] BF16/F32 '%s'", w->name, (long long)br, (long long)bc, sn);
    unsigned char *raw = malloc(s->nbytes);
    float *f = malloc((size_t)s->n_elem * sizeof *f);
    int rc = raw && f ? qf_st_read(&p->st, s->data, raw, s->nbytes) : qf_fail(QF_ENOMEM, "out of memory");
    for (int64_t i = 0; rc == QF_OK && i < s->n_elem; i++) {
        if (s->dtype == QF_DT_F32) memcpy(&f[i], raw + 4 * i, 4);
        else f[i] = qf_bf16_to_f32((uint16_t)(raw[2 * i] | raw[2 * i + 1] << 8));
    }
    free(raw);
    if (rc != QF_OK) free(f), f = NULL;
    *out = f;
    return rc;
}

/* A weight converted to fmt: rows [row0, row0 + rows) of t (3-D flattened), under name, shaped
 * [lead..., rows, cols] as the format stores it. fp8 is followed by its scales' job. */
static int add_convert(plan *p, const char *name, const qf_st_tensor *t, int fmt, int64_t row0, int64_t rows, int lead_dims) {
    job *j = add(p, name, J_CONVERT, t);
    if (!j) return qf_fail(QF_ENOMEM, "out of memory");
    j->fmt = fmt, j->row0 = row0, j->rows = rows;
    if (t->dtype == QF_DT_F8_E4M3) {
        int rc = read_scales(p, t, &j->src_scales);
        if (rc != QF_OK) return rc;
    }
    j->ndim = lead_dims + 2;
    j->shape[j->ndim - 2] = lead_dims ? t->shape[1] : rows;
    if (lead_dims) j->shape[0] = t->shape[0];
    qf_mat m = {fmt, NULL, rows, j->cols, NULL};
    j->shape[j->ndim - 1] = qf_is_quant(fmt) && fmt != QF_Q_FP8B128 ? (int64_t)qf_q_row_bytes(fmt, j->cols) : j->cols;
    j->nbytes = fmt == QF_DT_BF16 ? (uint64_t)(rows * j->cols) * 2 : qf_mat_bytes(&m);
    if (fmt != QF_Q_FP8B128) return QF_OK;
    int64_t cols = j->cols; /* add() may move the jobs */
    char sn[1024];
    snprintf(sn, sizeof sn, "%s_scale_inv", name);
    job *s = add(p, sn, J_SCALES, t);
    if (!s) return qf_fail(QF_ENOMEM, "out of memory");
    s->ndim = 2, s->shape[0] = (rows + 127) / 128, s->shape[1] = (cols + 127) / 128;
    s->nbytes = (uint64_t)(s->shape[0] * s->shape[1]) * 4;
    return QF_OK;
}

/* Fused [E, 2I, H] / [E, H, I] experts as fp8 go one by one, in the official names. */
static int add_split_fp8(plan *p, const qf_st_tensor *t) {
    int gu = ends_with(t->name, "gate_up_proj");
    size_t stem = strlen(t->name) - strlen(gu ? "gate_up_proj" : "down_proj");
    int64_t R = t->shape[1];
    for (int64_t e = 0; e < t->shape[0]; e++)
        for (int part = 0; part < (gu ? 2 : 1); part++) {
            char n[1024];
            snprintf(n, sizeof n, "%.*s%lld.%s_proj.weight", (int)stem, t->name, (long long)e, gu ? (part ? "up" : "gate") : "down");
            int64_t rows = gu ? R / 2 : R;
            int rc = add_convert(p, n, t, QF_Q_FP8B128, e * R + part * rows, rows, 0);
            if (rc != QF_OK) return rc;
        }
    return QF_OK;
}

static int float_dt(int dt) { return dt == QF_DT_BF16 || dt == QF_DT_F16 || dt == QF_DT_F32; }

static int plan_tensor(plan *p, const qf_st_tensor *t) {
    const qf_quantize_opts *o = p->o;
    if (ends_with(t->name, "_scale_inv")) {
        char w[1024];
        snprintf(w, sizeof w, "%.*s", (int)(strlen(t->name) - 10), t->name);
        const qf_st_tensor *wt = qf_st_find(&p->st, w);
        if (wt && wt->dtype == QF_DT_F8_E4M3) return QF_OK; /* goes with its weight */
    }
    int fmt = is_expert(t->name) ? o->experts : qf_quant_trunk_format(t->name, o->trunk);
    if (fmt == QF_Q_FP8B128 && t->dtype == QF_DT_F8_E4M3) fmt = 0;
    if (fmt == QF_DT_BF16 && t->dtype == QF_DT_BF16) fmt = 0;
    if (!fmt) { /* as stored: an FP8 weight keeps its scales beside it */
        char sn[1024];
        snprintf(sn, sizeof sn, "%s_scale_inv", t->name);
        const qf_st_tensor *s = t->dtype == QF_DT_F8_E4M3 ? qf_st_find(&p->st, sn) : NULL;
        if (!add(p, t->name, J_COPY, t) || (s && !add(p, sn, J_COPY, s))) return qf_fail(QF_ENOMEM, "out of memory");
        return QF_OK;
    }
    if (!float_dt(t->dtype) && t->dtype != QF_DT_F8_E4M3)
        return qf_fail(QF_EFORMAT, "tensor '%s' has dtype %s; qflash quantize reads BF16, F16, F32 and F8_E4M3 weights", t->name, qf_dtype_name(t->dtype));
    if ((t->ndim != 2 && t->ndim != 3) || (t->ndim == 3 && t->dtype == QF_DT_F8_E4M3))
        return qf_fail(QF_EFORMAT, "tensor '%s': cannot quantise a %d-D %s weight", t->name, t->ndim, qf_dtype_name(t->dtype));
    int64_t cols = t->shape[t->ndim - 1];
    if ((fmt == QF_Q_I8B32 || fmt == QF_Q_I4B32) && cols % QF_Q_BLOCK)
        return qf_fail(QF_EFORMAT, "tensor '%s': %lld columns are not whole blocks of %d", t->name, (long long)cols, QF_Q_BLOCK);
    if (fmt == QF_Q_FP8B128 && t->ndim == 3) return add_split_fp8(p, t);
    int64_t rows = t->n_elem / cols;
    return add_convert(p, t->name, t, fmt, 0, rows, t->ndim == 3);
}

static int cmp_name(const void *a, const void *b) {
    return strcmp((*(const qf_st_tensor *const *)a)->name, (*(const qf_st_tensor *const *)b)->name);
}

/* Bytes of one input row of a job's source. */
static size_t in_row_bytes(const job *j) { return j->src->nbytes / (size_t)(j->src->n_elem / j->cols); }

static int make_plan(plan *p) {
    const qf_st_tensor **by = malloc((size_t)(p->st.n_tensors + 1) * sizeof *by);
    if (!by) return qf_fail(QF_ENOMEM, "out of memory");
    for (int i = 0; i < p->st.n_tensors; i++) by[i] = &p->st.tensors[i];
    qsort(by, (size_t)p->st.n_tensors, sizeof *by, cmp_name);
    int rc = QF_OK;
    for (int i = 0; rc == QF_OK && i < p->st.n_tensors; i++) rc = plan_tensor(p, by[i]);
    free(by);
    uint64_t cap = p->o->shard_bytes ? p->o->shard_bytes : (4ull << 30), in_shard = 0;
    p->n_shards = p->n ? 1 : 0;
    for (int i = 0; i < p->n; i++) {
        job *j = &p->jobs[i];
        if (in_shard && in_shard + j->nbytes > cap && j->kind != J_SCALES && !ends_with(j->name, "_scale_inv")) p->n_shards++, in_shard = 0;
        j->shard = p->n_shards - 1, in_shard += j->nbytes;
        p->total += j->kind == J_COPY ? j->nbytes : j->kind == J_CONVERT ? (uint64_t)j->rows * in_row_bytes(j) : 0;
    }
    return rc;
}

/* ---- converting a chunk of rows ---- */

typedef struct chunk {
    const job *j;
    const unsigned char *in; /* the chunk's input rows */
    unsigned char *out;      /* its output rows */
    int64_t r0, rows;        /* rows of the job (r0 from its first) */
    float *scratch;          /* [tasks][2][cols] */
    float *scales;           /* fp8: the job's block scales */
    size_t in_row, out_row;
} chunk;

/* Row r of the chunk as fp32. */
static void row_f32(const chunk *c, int64_t r, float *f) {
    const job *j = c->j;
    const unsigned char *p = c->in + (size_t)r * c->in_row;
    if (j->src->dtype != QF_DT_F8_E4M3) {
        qf_float_row(j->src->dtype, p, j->cols, f);
        return;
    }
    int64_t sr = j->row0 + c->r0 + r; /* FP8 inputs are 2-D */
    for (int64_t i = 0; i < j->cols; i++) f[i] = qf_fp8_to_f32(p[i]) * j->src_scales[sr / 128 * ((j->cols + 127) / 128) + i / 128];
}

/* A task: a 128-row band (fp8 needs the band's block maxima first; the others go row by row). */
static void band_task(void *vc, int b) {
    chunk *c = vc;
    const job *j = c->j;
    float *f = c->scratch + (size_t)b * (size_t)j->cols;
    int64_t r1 = (int64_t)(b + 1) * 128 < c->rows ? (int64_t)(b + 1) * 128 : c->rows, nb = (j->cols + 127) / 128;
    float *sc = j->fmt == QF_Q_FP8B128 ? c->scales + (c->r0 / 128 + b) * nb : NULL;
    if (sc) {
        for (int64_t k = 0; k < nb; k++) sc[k] = 0.0f;
        for (int64_t r = (int64_t)b * 128; r < r1; r++) {
            row_f32(c, r, f);
            for (int64_t i = 0; i < j->cols; i++) sc[i / 128] = fmaxf(sc[i / 128], fabsf(f[i]) / 448.0f);
        }
    }
    for (int64_t r = (int64_t)b * 128; r < r1; r++) {
        unsigned char *o = c->out + (size_t)r * c->out_row;
        row_f32(c, r, f);
        if (sc)
            for (int64_t i = 0; i < j->cols; i++) o[i] = qf_f32_to_fp8(sc[i / 128] > 0 ? f[i] / sc[i / 128] : 0.0f);
        else if (j->fmt == QF_DT_BF16)
            for (int64_t i = 0; i < j->cols; i++) {
                uint16_t h = qf_f32_to_bf16(f[i]);
                o[2 * i] = (unsigned char)h, o[2 * i + 1] = (unsigned char)(h >> 8);
            }
        else qf_q_quantize_row(j->fmt, f, j->cols, o);
    }
}

typedef struct writer {
    plan *p;
    FILE *f;
    const char *path;
    unsigned char *in, *out;
    float *scratch;
    size_t cap_in, cap_out, cap_scratch;
} writer;

static int grow(void **buf, size_t *cap, size_t need) {
    if (need <= *cap) return QF_OK;
    void *b = realloc(*buf, need);
    if (!b) return qf_fail(QF_ENOMEM, "out of memory (%zu bytes of chunk buffer)", need);
    *buf = b, *cap = need;
    return QF_OK;
}

static void tick(plan *p, uint64_t bytes) {
    p->done += bytes;
    if (p->o->progress) p->o->progress(p->o->progress_ud, p->done, p->total);
}

static int write_out(writer *w, const void *b, size_t n) {
    return fwrite(b, 1, n, w->f) == n ? QF_OK : qf_fail(QF_EIO, "cannot write %s", w->path);
}

static int run_copy(writer *w, const job *j) {
    int rc = grow((void **)&w->in, &w->cap_in, CHUNK_BYTES);
    for (uint64_t at = 0; rc == QF_OK && at < j->nbytes; at += CHUNK_BYTES) {
        size_t n = j->nbytes - at < CHUNK_BYTES ? (size_t)(j->nbytes - at) : CHUNK_BYTES;
        rc = qf_st_read(&w->p->st, (const unsigned char *)j->src->data + at, w->in, n);
        if (rc == QF_OK) rc = write_out(w, w->in, n);
        tick(w->p, n);
    }
    return rc;
}

static int run_convert(writer *w, job *j) {
    size_t in_row = in_row_bytes(j), out_row = (size_t)(j->nbytes / (uint64_t)j->rows);
    int64_t band_rows = (int64_t)(CHUNK_BYTES / in_row) / 128 * 128;
    if (band_rows < 128) band_rows = 128;
    int64_t nb = (j->cols + 127) / 128;
    if (j->fmt == QF_Q_FP8B128 && !(j->scales = calloc((size_t)(((j->rows + 127) / 128) * nb), sizeof(float)))) return qf_fail(QF_ENOMEM, "out of memory");
    int rc = grow((void **)&w->in, &w->cap_in, (size_t)band_rows * in_row);
    if (rc == QF_OK) rc = grow((void **)&w->out, &w->cap_out, (size_t)band_rows * out_row);
    if (rc == QF_OK) rc = grow((void **)&w->scratch, &w->cap_scratch, (size_t)(band_rows / 128) * (size_t)j->cols * sizeof(float));
    for (int64_t r0 = 0; rc == QF_OK && r0 < j->rows; r0 += band_rows) {
        int64_t n = j->rows - r0 < band_rows ? j->rows - r0 : band_rows;
        rc = qf_st_read(&w->p->st, (const unsigned char *)j->src->data + (size_t)(j->row0 + r0) * in_row, w->in, (size_t)n * in_row);
        chunk c = {j, w->in, w->out, r0, n, w->scratch, j->scales, in_row, out_row};
        if (rc == QF_OK) qf_pool_run(w->p->o->pool, band_task, &c, (int)((n + 127) / 128));
        if (rc == QF_OK) rc = write_out(w, w->out, (size_t)n * out_row);
        tick(w->p, (uint64_t)n * in_row);
    }
    return rc;
}

static int write_shard(plan *p, int s, const char *path) {
    qf_st_entry *e = calloc((size_t)p->n + 1, sizeof *e);
    int n = 0;
    for (int i = 0; e && i < p->n; i++)
        if (p->jobs[i].shard == s) {
            const job *j = &p->jobs[i];
            const char *dt = j->kind == J_SCALES ? "F32" : j->kind == J_COPY ? qf_dtype_name(j->src->dtype)
                             : j->fmt == QF_Q_FP8B128 ? "F8_E4M3" : j->fmt == QF_DT_BF16 ? "BF16" : "U8";
            e[n] = (qf_st_entry){j->name, dt, j->ndim, {0}, j->nbytes};
            memcpy(e[n++].shape, j->shape, sizeof j->shape);
        }
    writer w = {p, e ? fopen(path, "wb") : NULL, path, NULL, NULL, NULL, 0, 0, 0};
    int rc = !e ? qf_fail(QF_ENOMEM, "out of memory") : !w.f ? qf_fail(QF_EIO, "cannot create %s", path) : qf_st_write_header(w.f, path, e, n);
    for (int i = 0; rc == QF_OK && i < p->n; i++) {
        job *j = &p->jobs[i];
        if (j->shard != s) continue;
        if (j->kind == J_COPY) rc = run_copy(&w, j);
        else if (j->kind == J_CONVERT) rc = run_convert(&w, j);
        else {
            rc = write_out(&w, p->jobs[i - 1].scales, (size_t)j->nbytes);
            free(p->jobs[i - 1].scales), p->jobs[i - 1].scales = NULL;
        }
    }
    if (w.f && fclose(w.f) != 0 && rc == QF_OK) rc = qf_fail(QF_EIO, "cannot write %s", path);
    free(e), free(w.in), free(w.out), free(w.scratch);
    return rc;
}

/* ---- the directory around the weights ---- */

static const char *fmt_name(int f) { return f == QF_DT_BF16 ? "bf16" : f ? qf_qfmt_name(f) : "as-stored"; }

static int write_config(const char *in, const char *out, const qf_quantize_opts *o) {
    char path[4096];
    snprintf(path, sizeof path, "%s/config.json", in);
    json_error_t err;
    json_t *root = json_load_file(path, JSON_PRESERVE_ORDER, &err);
    if (!root) return qf_fail_json(path, &err);
    json_t *tc = json_object_get(root, "text_config");
    if (json_is_object(tc)) json_object_del(tc, "quantization_config");
    json_object_set_new(root, "quantization_config", json_pack("{s:s,s:s,s:s,s:i,s:[i,i]}", "quant_method", "qflash", "experts", fmt_name(o->experts),
                                                               "trunk", fmt_name(o->trunk), "block_size", QF_Q_BLOCK, "fp8_weight_block_size", 128, 128));
    snprintf(path, sizeof path, "%s/config.json", out);
    int rc = json_dump_file(root, path, JSON_INDENT(2) | JSON_PRESERVE_ORDER) == 0 ? QF_OK : qf_fail(QF_EIO, "cannot write %s", path);
    json_decref(root);
    return rc;
}

static int copy_file(const char *from, const char *to) {
    FILE *a = fopen(from, "rb"), *b = a ? fopen(to, "wb") : NULL;
    char buf[1 << 16];
    size_t n;
    int ok = a && b;
    while (ok && (n = fread(buf, 1, sizeof buf, a)) > 0) ok = fwrite(buf, 1, n, b) == n;
    if (a) fclose(a);
    if (b && fclose(b) != 0) ok = 0;
    return ok ? QF_OK : qf_fail(QF_EIO, "cannot copy %s to %s", from, to);
}

static int skip_file(const char *n) {
    return n[0] == '.' || (!strncmp(n, "model", 5) && ends_with(n, ".safetensors")) || !strcmp(n, "model.safetensors.index.json") || !strcmp(n, "config.json") ||
           !strcmp(n, "SHA256SUMS");
}

static int copy_others(const char *in, const char *out) {
    DIR *d = opendir(in);
    if (!d) return qf_fail(QF_EIO, "cannot read %s", in);
    struct dirent *de;
    int rc = QF_OK;
    while (rc == QF_OK && (de = readdir(d))) {
        char a[4096], b[4096];
        struct stat sb;
        snprintf(a, sizeof a, "%s/%s", in, de->d_name);
        if (skip_file(de->d_name) || stat(a, &sb) != 0 || !S_ISREG(sb.st_mode)) continue;
        snprintf(b, sizeof b, "%s/%s", out, de->d_name);
        rc = copy_file(a, b);
    }
    closedir(d);
    return rc;
}

static void shard_name(const plan *p, int s, char *buf, size_t cap) {
    if (p->n_shards == 1) snprintf(buf, cap, "model.safetensors");
    else snprintf(buf, cap, "model-%05d-of-%05d.safetensors", s + 1, p->n_shards);
}

static int write_index(const plan *p, const char *out) {
    if (p->n_shards < 2) return QF_OK;
    json_t *map = json_object();
    uint64_t total = 0;
    for (int i = 0; i < p->n; i++) {
        char n[64];
        shard_name(p, p->jobs[i].shard, n, sizeof n);
        json_object_set_new(map, p->jobs[i].name, json_string(n));
        total += p->jobs[i].nbytes;
    }
    json_t *root = json_pack("{s:{s:I},s:o}", "metadata", "total_size", (json_int_t)total, "weight_map", map);
    char path[4096];
    snprintf(path, sizeof path, "%s/model.safetensors.index.json", out);
    int rc = json_dump_file(root, path, JSON_INDENT(2) | JSON_PRESERVE_ORDER) == 0 ? QF_OK : qf_fail(QF_EIO, "cannot write %s", path);
    json_decref(root);
    return rc;
}

static int cmp_str(const void *a, const void *b) { return strcmp(*(char *const *)a, *(char *const *)b); }

/* SHA256SUMS over every other file of out, sorted, as sha256sum writes it. */
static int write_manifest(const char *out) {
    DIR *d = opendir(out);
    if (!d) return qf_fail(QF_EIO, "cannot read %s", out);
    char *names[1024];
    int n = 0, rc = QF_OK;
    struct dirent *de;
    while ((de = readdir(d)) && n < 1024)
        if (de->d_name[0] != '.' && strcmp(de->d_name, "SHA256SUMS") && (names[n] = strdup(de->d_name))) n++;
    closedir(d);
    qsort(names, (size_t)n, sizeof *names, cmp_str);
    char path[4096];
    snprintf(path, sizeof path, "%s/SHA256SUMS", out);
    FILE *f = fopen(path, "w");
    if (!f) rc = qf_fail(QF_EIO, "cannot create %s", path);
    for (int i = 0; i < n; i++) {
        char p[4096], hex[65];
        snprintf(p, sizeof p, "%s/%s", out, names[i]);
        if (rc == QF_OK) rc = qf_sha256_file(p, hex);
        if (rc == QF_OK && fprintf(f, "%s  %s\n", hex, names[i]) < 0) rc = qf_fail(QF_EIO, "cannot write %s", path);
        free(names[i]);
    }
    if (f && fclose(f) != 0 && rc == QF_OK) rc = qf_fail(QF_EIO, "cannot write %s", path);
    return rc;
}

int qf_quantize_dir(const char *in, const char *out, const qf_quantize_opts *o) {
    qf_config cfg;
    int rc = qf_config_load(&cfg, in);
    if (rc != QF_OK) return rc;
    if (o->experts && o->experts != QF_Q_I8B32 && o->experts != QF_Q_I4B32 && o->experts != QF_Q_FP8B128)
        return qf_fail(QF_EINVAL, "experts: int8, int4 or fp8");
    if (o->trunk && o->trunk != QF_DT_BF16 && o->trunk != QF_Q_I8B32) return qf_fail(QF_EINVAL, "trunk: bf16 or int8");
    if (mkdir(out, 0755) != 0) {
        struct stat sb;
        if (stat(out, &sb) != 0 || !S_ISDIR(sb.st_mode)) return qf_fail(QF_EIO, "cannot make the directory %s", out);
    }
    plan p = {o, {0}, NULL, 0, 0, 0, 0, 0};
    rc = qf_st_open_dir(&p.st, in, NULL);
    if (rc == QF_OK) rc = make_plan(&p);
    for (int s = 0; rc == QF_OK && s < p.n_shards; s++) {
        char n[64], path[4096];
        shard_name(&p, s, n, sizeof n);
        snprintf(path, sizeof path, "%s/%s", out, n);
        rc = write_shard(&p, s, path);
    }
    if (rc == QF_OK) rc = write_index(&p, out);
    if (rc == QF_OK) rc = write_config(in, out, o);
    if (rc == QF_OK) rc = copy_others(in, out);
    if (rc == QF_OK) rc = write_manifest(out);
    for (int i = 0; i < p.n; i++) free(p.jobs[i].name), free(p.jobs[i].src_scales), free(p.jobs[i].scales);
    free(p.jobs);
    qf_st_close(&p.st);
    return rc;
}
