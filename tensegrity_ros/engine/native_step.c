/* The nodal engine's semi-implicit step, fused: one pass per tile of TB batch items, every step of a rollout.
 *
 * The same equations as laws.py (string law, generalised forces, bar multipliers with Baumgarte terms, symplectic
 * Euler, the mass-weighted projection with the step's chord inverse), in the batch-last layout of fast.py, for
 * rollouts that no gradient is asked of. Why a second writing of them: inductor turns one step into ~60 (icosahedron)
 * to ~280 (manipulator) loops, each a pass over the batch piece's buffers, and the step's ~2-10 kflop per item
 * are lost in those passes (stop 50: 0.4-2.4 us per item-step and thread). Here a tile's state, parameters and
 * every intermediate stay in a few tens of kB for all steps of the rollout, and every loop runs over the tile's
 * TB items, which gcc vectorises. test/test_engine_native.py holds it equal to the reference layout (float64,
 * 1e-12) on every nodal structure of config/models and the test structures (constraints, both string laws).
 *
 * Conventions (fast.py's batch-last layout): a coordinate array is (3, n, B), c * n + j the row of coordinate c of
 * entity j; a vector (n, B); constant matrices in gather form (out[o] = sum_k w[o][k] in[i[o][k]], laws._gather_form);
 * per-params arrays batch last with Bp = 1 (shared) or B (per item). Built by native.py with REAL = float or double.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#ifndef REAL
#define REAL double
#endif
#ifndef TB
#define TB 16
#endif
typedef REAL real;
typedef int64_t idx_t;

/* a loop over the tile's lanes. "omp simd" (built with -fopenmp-simd: no OpenMP runtime) because without it gcc
 * unrolled the 16-lane loops and vectorised only some of them (icosahedron, batch 1024: 3.7 M item-steps/s
 * without, 4.8 M with; docs/engine.md) */
#define FOR_B _Pragma("omp simd") for (int b = 0; b < TB; b++)

typedef struct {
    idx_t nf, N, nseg, S, A, nba, nblk;           /* free nodes, nodes, segments, strings, motors, bars, blocks */
    idx_t wCst, wG, wGt, wCsq, wCbt, wTt;           /* gather widths */
    const idx_t *Cst_i, *G_i, *Gt_i, *Csq_i, *Cbt_i, *Tt_i;
    const real *Cst_w, *G_w, *Gt_w, *Csq_w, *Cbt_w, *Tt_w;
    const real *scT, *dcT, *l2, *XcT;               /* (3, nseg), (3, nba), (nba), (3, N) */
    const idx_t *blk_ptr, *blk_idx;                 /* chord block j: bars blk_idx[blk_ptr[j] .. blk_ptr[j+1]) */
    idx_t pB;                                       /* the params' batch: 1 or B */
    const real *EA, *kc, *zeta, *xi00, *Y, *z;      /* (S), (S), (S), (S), (S, A), (A) */
    const real *Minv, *Pt, *Gc, *FgT;               /* (nf, nf), (nba, nf), (nba, nba), (3, nf) */
    real alpha, beta, dt;
    idx_t proj_iters;
} Model;

typedef real lane[TB];

/* Explicit vectors (gcc's vector extensions) for the tangent's lane arithmetic inside loops over a matrix's entries:
 * gcc 12 vectorised such loops itself, across the entries, with gathers (vgatherqpd), and the sparse products ran
 * 1.5x slower than testing every entry of the dense matrix; with vectorisation off they ran scalar. A tile of TB
 * lanes is NV vectors of VL. */
#define VBYTES 64
typedef real vec __attribute__((vector_size(VBYTES)));
#define VL ((int)(VBYTES / sizeof(real)))
#define NV (TB / VL)
static inline vec vld(const real *p) { vec v; memcpy(&v, p, sizeof v); return v; }
static inline void vst(real *p, vec v) { memcpy(p, &v, sizeof v); }

/* out[o] = sum_k w[o][k] in[i[o][k]] for o < n_out, for each of the ncoord coordinates */
static void gather(lane *out, const lane *in, idx_t n_out, idx_t n_in, int ncoord, const idx_t *i, const real *w,
                   idx_t width)
{
    for (int c = 0; c < ncoord; c++)
        for (idx_t o = 0; o < n_out; o++) {
            real acc[TB] = {0};
            for (idx_t k = 0; k < width; k++) {
                const real wk = w[o * width + k];
                if (wk == 0) continue;
                const real *x = in[c * n_in + i[o * width + k]];
                FOR_B acc[b] += wk * x[b];
            }
            memcpy(out[c * n_out + o], acc, sizeof acc);
        }
}

/* out (3, n_out) = X (3, n_in) M (n_in, n_out), M per item (lanes) */
static void dense(lane *out, const lane *X, const lane *M, idx_t n_in, idx_t n_out)
{
    for (int c = 0; c < 3; c++)
        for (idx_t j = 0; j < n_out; j++) {
            real acc[TB] = {0};
            for (idx_t i = 0; i < n_in; i++) {
                const real *x = X[c * n_in + i], *m = M[i * n_out + j];
                FOR_B acc[b] += x[b] * m[b];
            }
            memcpy(out[c * n_out + j], acc, sizeof acc);
        }
}

/* A tile's working arrays, carved out of one allocation (sizes in lanes) */
typedef struct {
    lane *EA, *kc, *zeta, *xi00, *Y, *z, *Minv, *Pt, *Gc, *FgT;     /* parameters, per lane */
    lane *q, *v, *s, *sd, *e, *xi, *xid, *len, *ld, *ten, *segt, *tmp, *F, *a0, *a, *d, *dd, *ad, *rhs, *lam,
         *Ainv, *blk;
} Tile;

static size_t tile_lanes(const Model *m, idx_t *ainv_size)
{
    idx_t sq = 0, mx = 0;
    for (idx_t j = 0; j < m->nblk; j++) {
        idx_t k = m->blk_ptr[j + 1] - m->blk_ptr[j];
        sq += k * k;
        if (k > mx) mx = k;
    }
    *ainv_size = sq;
    const idx_t nf = m->nf, S = m->S, A = m->A, nseg = m->nseg, nba = m->nba;
    size_t n = 4 * S + S * A + A + nf * nf + nba * nf + nba * nba + 3 * nf;       /* parameters */
    n += 2 * 3 * nf + 3 * 3 * nseg + 2 * nseg + 3 * S + nseg;                       /* q v s sd e xi xid len ld ten segt */
    idx_t t = 3 * nseg > 3 * nf ? 3 * nseg : 3 * nf;                               /* tmp */
    n += t + 3 * 3 * nf + 3 * 3 * nba + 2 * nba + sq + 2 * mx * mx;                /* F a0 a d dd ad rhs lam Ainv blk */
    return n;
}

static void tile_carve(Tile *t, lane *p, const Model *m, idx_t ainv_size)
{
    const idx_t nf = m->nf, S = m->S, A = m->A, nseg = m->nseg, nba = m->nba;
    idx_t mx = 0;
    for (idx_t j = 0; j < m->nblk; j++)
        if (m->blk_ptr[j + 1] - m->blk_ptr[j] > mx) mx = m->blk_ptr[j + 1] - m->blk_ptr[j];
#define TAKE(f, n) (t->f = p, p += (n))
    TAKE(EA, S); TAKE(kc, S); TAKE(zeta, S); TAKE(xi00, S); TAKE(Y, S * A); TAKE(z, A);
    TAKE(Minv, nf * nf); TAKE(Pt, nba * nf); TAKE(Gc, nba * nba); TAKE(FgT, 3 * nf);
    TAKE(q, 3 * nf); TAKE(v, 3 * nf); TAKE(s, 3 * nseg); TAKE(sd, 3 * nseg); TAKE(e, 3 * nseg);
    TAKE(xi, nseg); TAKE(xid, nseg); TAKE(len, S); TAKE(ld, S); TAKE(ten, S); TAKE(segt, nseg);
    TAKE(tmp, 3 * nseg > 3 * nf ? 3 * nseg : 3 * nf); TAKE(F, 3 * nf); TAKE(a0, 3 * nf); TAKE(a, 3 * nf);
    TAKE(d, 3 * nba); TAKE(dd, 3 * nba); TAKE(ad, 3 * nba); TAKE(rhs, nba); TAKE(lam, nba);
    TAKE(Ainv, ainv_size); TAKE(blk, 2 * mx * mx);
#undef TAKE
}

/* rows [0, n) of a batch-last array (n, B) at items b0 .. b0 + TB (the tile's last item repeated past nb) into lanes;
 * stride 0 for parameters shared by the batch */
static void load(lane *dst, const real *src, idx_t n, idx_t B, idx_t b0, idx_t nb, int shared)
{
    for (idx_t r = 0; r < n; r++)
        FOR_B {
            const idx_t bi = b < nb ? b : nb - 1;
            dst[r][b] = shared ? src[r] : src[r * B + b0 + bi];
        }
}

/* x = Ainv r, block by block (Ainv as stored by chord_inverse) */
static void chord_solve(const Model *m, const Tile *t, lane *x, const lane *r)
{
    idx_t off = 0;
    for (idx_t j = 0; j < m->nblk; j++) {
        const idx_t *g = m->blk_idx + m->blk_ptr[j];
        const idx_t k = m->blk_ptr[j + 1] - m->blk_ptr[j];
        for (idx_t p = 0; p < k; p++) {
            real acc[TB] = {0};
            for (idx_t q = 0; q < k; q++) {
                const real *ai = t->Ainv[off + p * k + q], *rq = r[g[q]];
                FOR_B acc[b] += ai[b] * rq[b];
            }
            memcpy(x[g[p]], acc, sizeof acc);
        }
        off += k * k;
    }
}

/* Ainv of the chord matrix A_ij = Gc_ij (d_i . d_j), block by block, by Gauss-Jordan without pivoting (SPD) */
static void chord_inverse(const Model *m, Tile *t)
{
    idx_t off = 0;
    for (idx_t j = 0; j < m->nblk; j++) {
        const idx_t *g = m->blk_idx + m->blk_ptr[j];
        const idx_t k = m->blk_ptr[j + 1] - m->blk_ptr[j], w = 2 * k;
        lane *M = t->blk;                                       /* (k, 2k) */
        for (idx_t p = 0; p < k; p++)
            for (idx_t q = 0; q < k; q++) {
                const real *gc = t->Gc[g[p] * m->nba + g[q]];
                real *out = M[p * w + q], *eye = M[p * w + k + q];
                FOR_B {
                    real dot = 0;
                    for (int c = 0; c < 3; c++) dot += t->d[c * m->nba + g[p]][b] * t->d[c * m->nba + g[q]][b];
                    out[b] = gc[b] * dot;
                    eye[b] = p == q;
                }
            }
        for (idx_t r = 0; r < k; r++) {
            real inv[TB];
            FOR_B inv[b] = 1 / M[r * w + r][b];
            for (idx_t col = 0; col < w; col++) FOR_B M[r * w + col][b] *= inv[b];
            for (idx_t p = 0; p < k; p++) {
                if (p == r) continue;
                real f[TB];
                FOR_B f[b] = M[p * w + r][b];
                for (idx_t col = 0; col < w; col++) FOR_B M[p * w + col][b] -= f[b] * M[r * w + col][b];
            }
        }
        for (idx_t p = 0; p < k; p++)
            for (idx_t q = 0; q < k; q++) memcpy(t->Ainv[off + p * k + q], M[p * w + k + q], sizeof(lane));
        off += k * k;
    }
}

/* d (3, nba) = the bars' vectors at positions x */
static void bar_vectors(const Model *m, lane *d, const lane *x)
{
    gather(d, x, m->nba, m->nf, 3, m->Cbt_i, m->Cbt_w, m->wCbt);
    for (int c = 0; c < 3; c++)
        for (idx_t j = 0; j < m->nba; j++) {
            const real dc = m->dcT[c * m->nba + j];
            FOR_B d[c * m->nba + j][b] += dc;
        }
}

/* x -= Pt^T (y * d): the mass-weighted correction along the bars */
static void bar_correction(const Model *m, Tile *t, lane *x, const lane *y)
{
    const idx_t nba = m->nba;
    for (int c = 0; c < 3; c++)
        for (idx_t j = 0; j < nba; j++) FOR_B t->ad[c * nba + j][b] = y[j][b] * t->d[c * nba + j][b];
    dense(t->tmp, t->ad, t->Pt, nba, m->nf);
    for (idx_t r = 0; r < 3 * m->nf; r++) FOR_B x[r][b] -= t->tmp[r][b];
}

/* one semi-implicit step of the tile; u, ud, fq: this step's inputs at the tile (lanes), or NULL */
static void step(const Model *m, Tile *t, const lane *u, const lane *ud, const lane *fq)
{
    const idx_t nf = m->nf, nseg = m->nseg, S = m->S, A = m->A, nba = m->nba;
    /* strings: segment vectors, lengths, unit vectors, rates; composite lengths; the Kelvin-Voigt pull */
    gather(t->s, t->q, nseg, nf, 3, m->Cst_i, m->Cst_w, m->wCst);
    gather(t->sd, t->v, nseg, nf, 3, m->Cst_i, m->Cst_w, m->wCst);
    for (idx_t j = 0; j < nseg; j++) {
        real *s0 = t->s[j], *s1 = t->s[nseg + j], *s2 = t->s[2 * nseg + j];
        const real sc0 = m->scT[j], sc1 = m->scT[nseg + j], sc2 = m->scT[2 * nseg + j];
        FOR_B {
            const real x0 = s0[b] + sc0, x1 = s1[b] + sc1, x2 = s2[b] + sc2;
            const real l = sqrt(x0 * x0 + x1 * x1 + x2 * x2);
            const real e0 = x0 / l, e1 = x1 / l, e2 = x2 / l;
            t->e[j][b] = e0; t->e[nseg + j][b] = e1; t->e[2 * nseg + j][b] = e2;
            t->xi[j][b] = l;
            t->xid[j][b] = e0 * t->sd[j][b] + e1 * t->sd[nseg + j][b] + e2 * t->sd[2 * nseg + j][b];
        }
    }
    gather(t->len, t->xi, S, nseg, 1, m->G_i, m->G_w, m->wG);
    gather(t->ld, t->xid, S, nseg, 1, m->G_i, m->G_w, m->wG);
    for (idx_t j = 0; j < S; j++) {
        real xi0[TB], xi0d[TB];
        FOR_B { xi0[b] = t->xi00[j][b]; xi0d[b] = 0; }
        if (u != NULL)
            for (idx_t k = 0; k < A; k++) {
                const real *y = t->Y[j * A + k];
                FOR_B xi0[b] += y[b] * (u[k][b] - t->z[k][b]);
                if (ud != NULL) FOR_B xi0d[b] += y[b] * ud[k][b];
            }
        FOR_B {
            const real D = t->len[j][b] - xi0[b], Dd = t->ld[j][b] - xi0d[b];
            const real kappa = t->EA[j][b] / xi0[b] + t->kc[j][b];
            const real f = kappa * D + t->zeta[j][b] * Dd;
            t->ten[j][b] = D > 0 && f > 0 ? f : 0;
        }
    }
    /* generalised forces F = FgT - Cs_q^T (t_seg e) + fext, and the unconstrained acceleration a0 = F Minv */
    gather(t->segt, t->ten, nseg, S, 1, m->Gt_i, m->Gt_w, m->wGt);
    for (int c = 0; c < 3; c++)
        for (idx_t j = 0; j < nseg; j++) FOR_B t->tmp[c * nseg + j][b] = t->segt[j][b] * t->e[c * nseg + j][b];
    gather(t->F, t->tmp, nf, nseg, 3, m->Csq_i, m->Csq_w, m->wCsq);
    for (idx_t r = 0; r < 3 * nf; r++)
        FOR_B t->F[r][b] = t->FgT[r][b] - t->F[r][b] + (fq != NULL ? fq[r][b] : 0);
    dense(t->a0, t->F, t->Minv, nf, nf);
    const lane *acc = t->a0;
    if (nba > 0) {
        /* the bar multipliers: A lam = -|d'|^2 - d . (C_b a0) - 2 alpha d . d' - beta^2 g */
        bar_vectors(m, t->d, t->q);
        gather(t->dd, t->v, nba, nf, 3, m->Cbt_i, m->Cbt_w, m->wCbt);
        gather(t->ad, t->a0, nba, nf, 3, m->Cbt_i, m->Cbt_w, m->wCbt);
        for (idx_t j = 0; j < nba; j++) {
            const real l2 = m->l2[j];
            FOR_B {
                real dd2 = 0, dad = 0, ddd = 0, d2 = 0;
                for (int c = 0; c < 3; c++) {
                    const real dc = t->d[c * nba + j][b], ddc = t->dd[c * nba + j][b];
                    dd2 += ddc * ddc; dad += dc * t->ad[c * nba + j][b]; ddd += dc * ddc; d2 += dc * dc;
                }
                t->rhs[j][b] = -dd2 - dad - 2 * m->alpha * ddd - m->beta * m->beta * (0.5 * (d2 - l2));
            }
        }
        chord_inverse(m, t);
        chord_solve(m, t, t->lam, t->rhs);
        for (idx_t r = 0; r < 3 * nf; r++) FOR_B t->a[r][b] = t->a0[r][b];
        for (int c = 0; c < 3; c++)
            for (idx_t j = 0; j < nba; j++) FOR_B t->ad[c * nba + j][b] = t->lam[j][b] * t->d[c * nba + j][b];
        dense(t->tmp, t->ad, t->Pt, nba, nf);
        for (idx_t r = 0; r < 3 * nf; r++) FOR_B t->a[r][b] += t->tmp[r][b];
        acc = t->a;
    }
    /* symplectic Euler */
    for (idx_t r = 0; r < 3 * nf; r++)
        FOR_B {
            t->v[r][b] += m->dt * acc[r][b];
            t->q[r][b] += m->dt * t->v[r][b];
        }
    if (nba == 0 || m->proj_iters <= 0) return;
    /* the projection with the step's chord inverse: positions onto |d| = l (Gauss-Newton), velocities onto d.d' = 0 */
    for (idx_t it = 0; it < m->proj_iters; it++) {
        bar_vectors(m, t->d, t->q);
        for (idx_t j = 0; j < nba; j++) {
            const real l2 = m->l2[j];
            FOR_B {
                real d2 = 0;
                for (int c = 0; c < 3; c++) d2 += t->d[c * nba + j][b] * t->d[c * nba + j][b];
                t->rhs[j][b] = 0.5 * (d2 - l2);
            }
        }
        chord_solve(m, t, t->lam, t->rhs);
        bar_correction(m, t, t->q, t->lam);
    }
    bar_vectors(m, t->d, t->q);
    gather(t->dd, t->v, nba, nf, 3, m->Cbt_i, m->Cbt_w, m->wCbt);
    for (idx_t j = 0; j < nba; j++)
        FOR_B {
            real dot = 0;
            for (int c = 0; c < 3; c++) dot += t->d[c * nba + j][b] * t->dd[c * nba + j][b];
            t->rhs[j][b] = dot;
        }
    chord_solve(m, t, t->lam, t->rhs);
    bar_correction(m, t, t->v, t->lam);
}

/* n steps of items [b0, b1) of a batch of B. Q, V (3, nf, B): the start, overwritten with the last state.
 * u, ud (n, A, B), fq (n, 3, nf, B) or NULL. Outputs X, Vout: item b of step k at [k * sK + b * sB], (N, 3) each
 * (fixed nodes at XcT, at rest). Returns 0, or -1 when the working arrays could not be allocated. */
int rollout(const Model *m, idx_t B, idx_t b0, idx_t b1, idx_t n, real *Q, real *V, const real *u, const real *ud,
            const real *fq, real *X, real *Vout, idx_t sK, idx_t sB)
{
    idx_t ainv_size;
    const size_t lanes = tile_lanes(m, &ainv_size);
    const idx_t nf = m->nf, N = m->N, A = m->A;
    lane *mem = aligned_alloc(64, (lanes + 3 * N + 2 * A + 3 * nf) * sizeof(lane));
    if (mem == NULL) return -1;
    Tile t;
    tile_carve(&t, mem, m, ainv_size);
    lane *full = mem + lanes;                                       /* (3, N) node rows for the outputs */
    lane *in_u = full + 3 * N, *in_ud = in_u + A, *in_f = in_ud + A; /* this step's inputs */
    const int shared = m->pB == 1;
    for (idx_t t0 = b0; t0 < b1; t0 += TB) {
        const idx_t nb = b1 - t0 < TB ? b1 - t0 : TB;
        load(t.EA, m->EA, m->S, B, t0, nb, shared); load(t.kc, m->kc, m->S, B, t0, nb, shared);
        load(t.zeta, m->zeta, m->S, B, t0, nb, shared); load(t.xi00, m->xi00, m->S, B, t0, nb, shared);
        load(t.Y, m->Y, m->S * A, B, t0, nb, shared); load(t.z, m->z, A, B, t0, nb, shared);
        load(t.Minv, m->Minv, nf * nf, B, t0, nb, shared); load(t.Pt, m->Pt, m->nba * nf, B, t0, nb, shared);
        load(t.Gc, m->Gc, m->nba * m->nba, B, t0, nb, shared); load(t.FgT, m->FgT, 3 * nf, B, t0, nb, shared);
        load(t.q, Q, 3 * nf, B, t0, nb, 0);
        load(t.v, V, 3 * nf, B, t0, nb, 0);
        for (idx_t k = 0; k < n; k++) {
            if (u != NULL) load(in_u, u + k * A * B, A, B, t0, nb, 0);
            if (ud != NULL) load(in_ud, ud + k * A * B, A, B, t0, nb, 0);
            if (fq != NULL) load(in_f, fq + k * 3 * nf * B, 3 * nf, B, t0, nb, 0);
            step(m, &t, u != NULL ? in_u : NULL, u != NULL && ud != NULL ? in_ud : NULL, fq != NULL ? in_f : NULL);
            /* full node positions and velocities, (N, 3) per item */
            for (int which = 0; which < 2; which++) {
                gather(full, which ? t.v : t.q, N, nf, 3, m->Tt_i, m->Tt_w, m->wTt);
                real *out = (which ? Vout : X) + k * sK;
                for (idx_t b = 0; b < nb; b++)
                    for (idx_t j = 0; j < N; j++)
                        for (int c = 0; c < 3; c++)
                            out[(t0 + b) * sB + j * 3 + c] = full[c * N + j][b] + (which ? 0 : m->XcT[c * N + j]);
            }
        }
        for (idx_t r = 0; r < 3 * nf; r++)
            for (idx_t b = 0; b < nb; b++) {
                Q[r * B + t0 + b] = t.q[r][b];
                V[r * B + t0 + b] = t.v[r][b];
            }
    }
    free(mem);
    return 0;
}

/* ==================================================================================================================
 * The step's tangent: forward sensitivities of ONE item's rollout in C directions at once (what tangent.py's
 * rollout_tangents computes with dense transition matrices, for identification's Jacobians). The lanes are the
 * directions here, not batch items: each step, the primal is stepped once in scalars, keeping what its tangent
 * needs, then every tile of TB directions goes through the same step differentiated by hand, operation by operation
 * (the string law, the forces, the bar multipliers with the step's chord inverse, symplectic Euler, the projection
 * with that inverse, including its dependence on the step-start state and on the masses). Why not the dense
 * transition matrices: their products cost ~10 Mflop per window and step on the manipulator, ~3x what the step's
 * own operations on the directions cost, and are issued as ~200 small torch operations per batch of steps.
 * test/test_engine_native_tangent.py holds it equal to tangent.rollout_tangents (float64) on four structures
 * (the icosahedron, the manipulator, one with constraints, one with both string laws).
 * ================================================================================================================== */

typedef struct {
    idx_t C, P;                                   /* directions (a multiple of TB); the first P are parameters' */
    /* the per-params quantities' derivatives along the directions, (rows, C) each, zero past P:
     * EA, kc, zeta, xi00 (S); Y (S * A); z (A); Minv (nf * nf); Pt (nba * nf); Gc (nba * nba); FgT (3 * nf) */
    const real *dEA, *dkc, *dzeta, *dxi00, *dY, *dz, *dMinv, *dPt, *dGc, *dFgT;
} Tangents;

/* scalar forms of gather and dense, for the primal (one item, parameters shared) */
static void sgather(real *out, const real *in, idx_t n_out, idx_t n_in, int ncoord, const idx_t *i, const real *w,
                    idx_t width)
{
    for (int c = 0; c < ncoord; c++)
        for (idx_t o = 0; o < n_out; o++) {
            real acc = 0;
            for (idx_t k = 0; k < width; k++) {
                const real wk = w[o * width + k];
                if (wk != 0) acc += wk * in[c * n_in + i[o * width + k]];
            }
            out[c * n_out + o] = acc;
        }
}

static void sdense(real *out, const real *X, const real *M, idx_t n_in, idx_t n_out)
{
    for (int c = 0; c < 3; c++)
        for (idx_t j = 0; j < n_out; j++) {
            real acc = 0;
            for (idx_t i = 0; i < n_in; i++) acc += X[c * n_in + i] * M[i * n_out + j];
            out[c * n_out + j] = acc;
        }
}

/* the structural non-zeros of an (n_in, n_out) matrix by output column: column j reads rows idx[ptr[j] .. ptr[j+1]).
 * Why: the masses' inverse and the bar-to-node map are 60-65 % zeros on the manipulator, and testing each entry
 * inside the lane loops cost more than the products (a third of the tangent's time went to these two products) */
typedef struct {
    idx_t *ptr, *idx;
} Pattern;

/* the pattern of M (n_in * n_out rows of row stride ld): (i, j) is a non-zero when any of its first ncol entries is;
 * ptr, idx: n_out + 1 and n_in * n_out slots */
static Pattern pattern_of(const real *M, idx_t n_in, idx_t n_out, idx_t ld, idx_t ncol, idx_t *ptr, idx_t *idx)
{
    Pattern pt = {ptr, idx};
    idx_t k = 0;
    for (idx_t j = 0; j < n_out; j++) {
        ptr[j] = k;
        for (idx_t i = 0; i < n_in; i++) {
            int nz = 0;
            for (idx_t c = 0; c < ncol && !nz; c++) nz = M[(i * n_out + j) * ld + c] != 0;
            if (nz) idx[k++] = i;
        }
    }
    ptr[n_out] = k;
    return pt;
}

/* out (3, n_out) lanes = X (3, n_in) lanes times the scalar M (n_in, n_out) of pattern pt */
static void tdense(lane *out, const lane *X, const real *M, const Pattern *pt, idx_t n_in, idx_t n_out)
{
    for (int c = 0; c < 3; c++)
        for (idx_t j = 0; j < n_out; j++) {
            vec acc[NV];
            for (int v = 0; v < NV; v++) acc[v] = (vec){0};
            for (idx_t k = pt->ptr[j]; k < pt->ptr[j + 1]; k++) {
                const idx_t i = pt->idx[k];
                const real mij = M[i * n_out + j], *x = X[c * n_in + i];
                for (int v = 0; v < NV; v++) acc[v] += vld(x + v * VL) * mij;
            }
            for (int v = 0; v < NV; v++) vst(out[c * n_out + j] + v * VL, acc[v]);
        }
}

/* out (3, n_out) lanes += sign * X (3, n_in) scalar times dM (n_in * n_out rows of the tile's lanes, row stride C,
 * pattern pt) */
static void tdense_dm(lane *out, const real *X, const real *dM, const Pattern *pt, idx_t C, idx_t n_in, idx_t n_out,
                      real sign)
{
    for (int c = 0; c < 3; c++)
        for (idx_t j = 0; j < n_out; j++) {
            vec acc[NV];
            for (int v = 0; v < NV; v++) acc[v] = (vec){0};
            for (idx_t k = pt->ptr[j]; k < pt->ptr[j + 1]; k++) {
                const idx_t i = pt->idx[k];
                const real x = sign * X[c * n_in + i], *dm = dM + (i * n_out + j) * C;
                for (int v = 0; v < NV; v++) acc[v] += vld(dm + v * VL) * x;
            }
            real *o = out[c * n_out + j];
            for (int v = 0; v < NV; v++) vst(o + v * VL, vld(o + v * VL) + acc[v]);
        }
}

/* the primal's working arrays (one item) */
typedef struct {
    real *q, *v, *s, *sd, *e, *xi, *xid, *len, *ld, *xi0, *xi0d, *D, *Dd, *kap, *act, *ten, *segt, *tmp, *F, *a0, *a,
         *d0, *dd0, *ad0, *lam0, *rhs, *Ainv, *blk, *dit, *lamit, *dv, *ddv, *lamv, *ld0;
} Prim;

/* the tangent's working arrays (one tile of directions) */
typedef struct {
    lane *ds, *dsd, *de, *dxi, *dxid, *dlen, *dld, *dten, *dsegt, *dtmp, *dF, *da, *dbar0, *ddd, *dad, *drhs, *dlam,
         *dAx, *wrk, *dcor, *dbar;
    Pattern Minv, Pt, dMinv, dPt;                 /* the non-zeros of the products' matrices, fixed for the call */
} TWork;

/* x = Ainv r for lanes r with the scalar block inverse */
static void tchord_solve(const Model *m, const real *Ainv, lane *x, const lane *r)
{
    idx_t off = 0;
    for (idx_t j = 0; j < m->nblk; j++) {
        const idx_t *g = m->blk_idx + m->blk_ptr[j];
        const idx_t k = m->blk_ptr[j + 1] - m->blk_ptr[j];
        for (idx_t p = 0; p < k; p++) {
            vec acc[NV];
            for (int v = 0; v < NV; v++) acc[v] = (vec){0};
            for (idx_t q = 0; q < k; q++) {
                const real ai = Ainv[off + p * k + q], *rq = r[g[q]];
                for (int v = 0; v < NV; v++) acc[v] += vld(rq + v * VL) * ai;
            }
            for (int v = 0; v < NV; v++) vst(x[g[p]] + v * VL, acc[v]);
        }
        off += k * k;
    }
}

/* (dA x)_p = sum over p's block of [dGc_pq (d_p . d_q) + Gc_pq (dd_p . d_q + d_p . dd_q)] x_q: the chord matrix's
 * tangent at the step start (d, dd: bar vectors and their tangent) applied to the scalar x; dGc NULL when the tile
 * has no parameter direction. Summed as dd_p . g + d_p . h with g = sum_q Gc_pq x_q d_q (scalars) and
 * h = sum_q Gc_pq x_q dd_q (lanes): 3 lane products per pair instead of 6 */
static void tchord_dA(const Model *m, lane *out, const real *x, const real *d, const lane *dd, const real *dGc,
                      idx_t C)
{
    const idx_t nba = m->nba;
    for (idx_t j = 0; j < m->nblk; j++) {
        const idx_t *g = m->blk_idx + m->blk_ptr[j];
        const idx_t k = m->blk_ptr[j + 1] - m->blk_ptr[j];
        for (idx_t p = 0; p < k; p++) {
            const idx_t bp = g[p];
            vec acc[NV], h[3][NV];
            real gs[3] = {0};
            for (int v = 0; v < NV; v++) acc[v] = h[0][v] = h[1][v] = h[2][v] = (vec){0};
            for (idx_t q = 0; q < k; q++) {
                const idx_t bq = g[q];
                const real sq = m->Gc[bp * nba + bq] * x[bq];
                for (int c = 0; c < 3; c++) {
                    const real *ddq = dd[c * nba + bq];
                    gs[c] += sq * d[c * nba + bq];
                    for (int v = 0; v < NV; v++) h[c][v] += vld(ddq + v * VL) * sq;
                }
                if (dGc != NULL) {
                    real dpq = 0;
                    for (int c = 0; c < 3; c++) dpq += d[c * nba + bp] * d[c * nba + bq];
                    const real *dgc = dGc + (bp * nba + bq) * C, cq = dpq * x[bq];
                    for (int v = 0; v < NV; v++) acc[v] += vld(dgc + v * VL) * cq;
                }
            }
            for (int c = 0; c < 3; c++) {
                const real *ddp = dd[c * nba + bp], dp = d[c * nba + bp];
                for (int v = 0; v < NV; v++) acc[v] += vld(ddp + v * VL) * gs[c] + h[c][v] * dp;
            }
            for (int v = 0; v < NV; v++) vst(out[bp] + v * VL, acc[v]);
        }
    }
}

/* d (3, nba) = bar vectors at x (scalars) */
static void sbar_vectors(const Model *m, real *d, const real *x)
{
    sgather(d, x, m->nba, m->nf, 3, m->Cbt_i, m->Cbt_w, m->wCbt);
    for (idx_t r = 0; r < 3 * m->nba; r++) d[r] += m->dcT[r];
}

/* the scalar chord inverse at the bar vectors p->d0 (chord_inverse's algorithm) */
static void schord_inverse(const Model *m, Prim *p)
{
    idx_t off = 0;
    const idx_t nba = m->nba;
    for (idx_t j = 0; j < m->nblk; j++) {
        const idx_t *g = m->blk_idx + m->blk_ptr[j];
        const idx_t k = m->blk_ptr[j + 1] - m->blk_ptr[j], w = 2 * k;
        real *M = p->blk;
        for (idx_t a = 0; a < k; a++)
            for (idx_t b = 0; b < k; b++) {
                real dot = 0;
                for (int c = 0; c < 3; c++) dot += p->d0[c * nba + g[a]] * p->d0[c * nba + g[b]];
                M[a * w + b] = m->Gc[g[a] * nba + g[b]] * dot;
                M[a * w + k + b] = a == b;
            }
        for (idx_t r = 0; r < k; r++) {
            const real inv = 1 / M[r * w + r];
            for (idx_t col = 0; col < w; col++) M[r * w + col] *= inv;
            for (idx_t a = 0; a < k; a++) {
                if (a == r) continue;
                const real f = M[a * w + r];
                for (idx_t col = 0; col < w; col++) M[a * w + col] -= f * M[r * w + col];
            }
        }
        for (idx_t a = 0; a < k; a++)
            for (idx_t b = 0; b < k; b++) p->Ainv[off + a * k + b] = M[a * w + k + b];
        off += k * k;
    }
}

static void schord_solve(const Model *m, const real *Ainv, real *x, const real *r)
{
    idx_t off = 0;
    for (idx_t j = 0; j < m->nblk; j++) {
        const idx_t *g = m->blk_idx + m->blk_ptr[j];
        const idx_t k = m->blk_ptr[j + 1] - m->blk_ptr[j];
        for (idx_t a = 0; a < k; a++) {
            real acc = 0;
            for (idx_t b = 0; b < k; b++) acc += Ainv[off + a * k + b] * r[g[b]];
            x[g[a]] = acc;
        }
        off += k * k;
    }
}

/* x (3 nf) -= (y * d) Pt, scalars; wrk (3 nba) and out (3 nf) scratch */
static void sbar_correction(const Model *m, real *x, const real *y, const real *d, real *wrk, real *out)
{
    const idx_t nba = m->nba;
    for (int c = 0; c < 3; c++)
        for (idx_t j = 0; j < nba; j++) wrk[c * nba + j] = y[j] * d[c * nba + j];
    sdense(out, wrk, m->Pt, nba, m->nf);
    for (idx_t r = 0; r < 3 * m->nf; r++) x[r] -= out[r];
}

/* one semi-implicit step of the primal (the step() above, in scalars), keeping what the tangent needs */
static void pstep(const Model *m, Prim *p, const real *u, const real *ud, const real *fq)
{
    const idx_t nf = m->nf, nseg = m->nseg, S = m->S, A = m->A, nba = m->nba;
    sgather(p->s, p->q, nseg, nf, 3, m->Cst_i, m->Cst_w, m->wCst);
    sgather(p->sd, p->v, nseg, nf, 3, m->Cst_i, m->Cst_w, m->wCst);
    for (idx_t j = 0; j < nseg; j++) {
        const real x0 = p->s[j] + m->scT[j], x1 = p->s[nseg + j] + m->scT[nseg + j],
                   x2 = p->s[2 * nseg + j] + m->scT[2 * nseg + j];
        const real l = sqrt(x0 * x0 + x1 * x1 + x2 * x2);
        p->e[j] = x0 / l; p->e[nseg + j] = x1 / l; p->e[2 * nseg + j] = x2 / l;
        p->xi[j] = l;
        p->xid[j] = p->e[j] * p->sd[j] + p->e[nseg + j] * p->sd[nseg + j] + p->e[2 * nseg + j] * p->sd[2 * nseg + j];
    }
    sgather(p->len, p->xi, S, nseg, 1, m->G_i, m->G_w, m->wG);
    sgather(p->ld, p->xid, S, nseg, 1, m->G_i, m->G_w, m->wG);
    for (idx_t j = 0; j < S; j++) {
        real xi0 = m->xi00[j], xi0d = 0;
        if (u != NULL)
            for (idx_t k = 0; k < A; k++) {
                xi0 += m->Y[j * A + k] * (u[k] - m->z[k]);
                if (ud != NULL) xi0d += m->Y[j * A + k] * ud[k];
            }
        const real D = p->len[j] - xi0, Dd = p->ld[j] - xi0d;
        const real kappa = m->EA[j] / xi0 + m->kc[j];
        const real f = kappa * D + m->zeta[j] * Dd;
        p->xi0[j] = xi0; p->xi0d[j] = xi0d; p->D[j] = D; p->Dd[j] = Dd; p->kap[j] = kappa;
        p->act[j] = D > 0 && f > 0;
        p->ten[j] = p->act[j] ? f : 0;
    }
    sgather(p->segt, p->ten, nseg, S, 1, m->Gt_i, m->Gt_w, m->wGt);
    for (int c = 0; c < 3; c++)
        for (idx_t j = 0; j < nseg; j++) p->tmp[c * nseg + j] = p->segt[j] * p->e[c * nseg + j];
    sgather(p->F, p->tmp, nf, nseg, 3, m->Csq_i, m->Csq_w, m->wCsq);
    for (idx_t r = 0; r < 3 * nf; r++) p->F[r] = m->FgT[r] - p->F[r] + (fq != NULL ? fq[r] : 0);
    sdense(p->a0, p->F, m->Minv, nf, nf);
    const real *acc = p->a0;
    if (nba > 0) {
        sbar_vectors(m, p->d0, p->q);
        sgather(p->dd0, p->v, nba, nf, 3, m->Cbt_i, m->Cbt_w, m->wCbt);
        sgather(p->ad0, p->a0, nba, nf, 3, m->Cbt_i, m->Cbt_w, m->wCbt);
        for (idx_t j = 0; j < nba; j++) {
            real dd2 = 0, dad = 0, ddd = 0, d2 = 0;
            for (int c = 0; c < 3; c++) {
                const real dc = p->d0[c * nba + j], ddc = p->dd0[c * nba + j];
                dd2 += ddc * ddc; dad += dc * p->ad0[c * nba + j]; ddd += dc * ddc; d2 += dc * dc;
            }
            p->rhs[j] = -dd2 - dad - 2 * m->alpha * ddd - m->beta * m->beta * (0.5 * (d2 - m->l2[j]));
        }
        schord_inverse(m, p);
        schord_solve(m, p->Ainv, p->lam0, p->rhs);
        for (int c = 0; c < 3; c++)
            for (idx_t j = 0; j < nba; j++) p->ld0[c * nba + j] = p->lam0[j] * p->d0[c * nba + j];
        sdense(p->a, p->ld0, m->Pt, nba, nf);
        for (idx_t r = 0; r < 3 * nf; r++) p->a[r] += p->a0[r];
        acc = p->a;
    }
    for (idx_t r = 0; r < 3 * nf; r++) {
        p->v[r] += m->dt * acc[r];
        p->q[r] += m->dt * p->v[r];
    }
    if (nba == 0 || m->proj_iters <= 0) return;
    for (idx_t it = 0; it < m->proj_iters; it++) {
        real *d = p->dit + it * 3 * nba, *lam = p->lamit + it * nba;
        sbar_vectors(m, d, p->q);
        for (idx_t j = 0; j < nba; j++) {
            real d2 = 0;
            for (int c = 0; c < 3; c++) d2 += d[c * nba + j] * d[c * nba + j];
            p->rhs[j] = 0.5 * (d2 - m->l2[j]);
        }
        schord_solve(m, p->Ainv, lam, p->rhs);
        sbar_correction(m, p->q, lam, d, p->tmp, p->tmp + 3 * nba);
    }
    sbar_vectors(m, p->dv, p->q);
    sgather(p->ddv, p->v, nba, nf, 3, m->Cbt_i, m->Cbt_w, m->wCbt);
    for (idx_t j = 0; j < nba; j++) {
        real dot = 0;
        for (int c = 0; c < 3; c++) dot += p->dv[c * nba + j] * p->ddv[c * nba + j];
        p->rhs[j] = dot;
    }
    schord_solve(m, p->Ainv, p->lamv, p->rhs);
    sbar_correction(m, p->v, p->lamv, p->dv, p->tmp, p->tmp + 3 * nba);
}

/* the tangent of a bar correction x -= (y d) Pt, or of the multipliers' acceleration x += (y d) Pt (sign -1 or +1):
 * dx += sign [(dy d + y dd) Pt + (y d) dPt] (dPt NULL: no parameter direction in the tile); yd: y * d (3 nba) */
static void tbar_update(const Model *m, const Tangents *tg, TWork *w, lane *dx, const lane *dy, const real *y,
                        const real *d, const lane *dd, const real *yd, const real *dPt, real sign)
{
    const idx_t nba = m->nba, nf = m->nf;
    for (int c = 0; c < 3; c++)
        for (idx_t j = 0; j < nba; j++) {
            const real dj = d[c * nba + j], yj = y[j];
            const real *dyj = dy[j], *ddj = dd[c * nba + j];
            FOR_B w->wrk[c * nba + j][b] = dyj[b] * dj + yj * ddj[b];
        }
    tdense(w->dcor, w->wrk, m->Pt, &w->Pt, nba, nf);
    if (dPt != NULL) tdense_dm(w->dcor, yd, dPt, &w->dPt, tg->C, nba, nf, 1);
    for (idx_t r = 0; r < 3 * nf; r++) FOR_B dx[r][b] += sign * w->dcor[r][b];
}

/* the tangent of pstep for one tile of directions (col0 = its first direction): dq, dv (3 nf lanes) in place.
 * du, dud: this step's motor-angle and rate tangents, (A, P) rows (direction p at [a * P + p]), or NULL */
static void tstep(const Model *m, const Tangents *tg, const Prim *p, TWork *w, lane *dq, lane *dv, idx_t col0,
                  const real *u, const real *ud, const real *du, const real *dud)
{
    const idx_t nf = m->nf, nseg = m->nseg, S = m->S, A = m->A, nba = m->nba, C = tg->C, P = tg->P;
    const int par = col0 < P;                     /* does the tile hold parameter directions? */
#define DT_(arr, r) (tg->arr + (r) * C + col0)
    gather(w->ds, dq, nseg, nf, 3, m->Cst_i, m->Cst_w, m->wCst);
    gather(w->dsd, dv, nseg, nf, 3, m->Cst_i, m->Cst_w, m->wCst);
    for (idx_t j = 0; j < nseg; j++) {
        const real e0 = p->e[j], e1 = p->e[nseg + j], e2 = p->e[2 * nseg + j], il = 1 / p->xi[j];
        const real s0 = p->sd[j], s1 = p->sd[nseg + j], s2 = p->sd[2 * nseg + j];
        lane *x0 = &w->ds[j], *x1 = &w->ds[nseg + j], *x2 = &w->ds[2 * nseg + j];
        lane *v0 = &w->dsd[j], *v1 = &w->dsd[nseg + j], *v2 = &w->dsd[2 * nseg + j];
        FOR_B {
            const real dl = e0 * (*x0)[b] + e1 * (*x1)[b] + e2 * (*x2)[b];
            const real f0 = ((*x0)[b] - e0 * dl) * il, f1 = ((*x1)[b] - e1 * dl) * il, f2 = ((*x2)[b] - e2 * dl) * il;
            w->de[j][b] = f0; w->de[nseg + j][b] = f1; w->de[2 * nseg + j][b] = f2;
            w->dxi[j][b] = dl;
            w->dxid[j][b] = f0 * s0 + f1 * s1 + f2 * s2 + e0 * (*v0)[b] + e1 * (*v1)[b] + e2 * (*v2)[b];
        }
    }
    gather(w->dlen, w->dxi, S, nseg, 1, m->G_i, m->G_w, m->wG);
    gather(w->dld, w->dxid, S, nseg, 1, m->G_i, m->G_w, m->wG);
    for (idx_t j = 0; j < S; j++) {
        if (!p->act[j]) { FOR_B w->dten[j][b] = 0; continue; }
        real dxi0[TB], dxi0d[TB];
        FOR_B { dxi0[b] = 0; dxi0d[b] = 0; }
        if (par) { const real *x = DT_(dxi00, j); FOR_B dxi0[b] = x[b]; }
        if (u != NULL)
            for (idx_t k = 0; k < A; k++) {
                const real y = m->Y[j * A + k];
                if (par) {
                    const real *dy = DT_(dY, j * A + k), *dz = DT_(dz, k);
                    const real um = u[k] - m->z[k], udk = ud != NULL ? ud[k] : 0;
                    FOR_B { dxi0[b] += dy[b] * um - y * dz[b]; dxi0d[b] += dy[b] * udk; }
                }
                if (y == 0) continue;
                if (du != NULL && par) FOR_B dxi0[b] += y * (col0 + b < P ? du[k * P + col0 + b] : 0);
                if (dud != NULL && par) FOR_B dxi0d[b] += y * (col0 + b < P ? dud[k * P + col0 + b] : 0);
            }
        const real xi0 = p->xi0[j], EA = m->EA[j], kap = p->kap[j], D = p->D[j], Dd = p->Dd[j], zeta = m->zeta[j];
        const real *dl = w->dlen[j], *dld = w->dld[j];
        if (par) {
            const real *dEA = DT_(dEA, j), *dkc = DT_(dkc, j), *dzeta = DT_(dzeta, j);
            FOR_B {
                const real dkap = dEA[b] / xi0 - EA * dxi0[b] / (xi0 * xi0) + dkc[b];
                w->dten[j][b] = dkap * D + kap * (dl[b] - dxi0[b]) + dzeta[b] * Dd + zeta * (dld[b] - dxi0d[b]);
            }
        } else {
            FOR_B {
                const real dkap = -EA * dxi0[b] / (xi0 * xi0);
                w->dten[j][b] = dkap * D + kap * (dl[b] - dxi0[b]) + zeta * (dld[b] - dxi0d[b]);
            }
        }
    }
    gather(w->dsegt, w->dten, nseg, S, 1, m->Gt_i, m->Gt_w, m->wGt);
    for (int c = 0; c < 3; c++)
        for (idx_t j = 0; j < nseg; j++) {
            const real st = p->segt[j], ec = p->e[c * nseg + j];
            FOR_B w->dtmp[c * nseg + j][b] = w->dsegt[j][b] * ec + st * w->de[c * nseg + j][b];
        }
    gather(w->dF, w->dtmp, nf, nseg, 3, m->Csq_i, m->Csq_w, m->wCsq);
    for (idx_t r = 0; r < 3 * nf; r++) {
        if (par) { const real *g = DT_(dFgT, r); FOR_B w->dF[r][b] = g[b] - w->dF[r][b]; }
        else FOR_B w->dF[r][b] = -w->dF[r][b];
    }
    tdense(w->da, w->dF, m->Minv, &w->Minv, nf, nf);
    if (par) tdense_dm(w->da, p->F, DT_(dMinv, 0), &w->dMinv, C, nf, nf, 1);
    const real *dGc = par ? DT_(dGc, 0) : NULL, *dPt = par ? DT_(dPt, 0) : NULL;
    if (nba > 0) {
        gather(w->dbar0, dq, nba, nf, 3, m->Cbt_i, m->Cbt_w, m->wCbt);
        gather(w->ddd, dv, nba, nf, 3, m->Cbt_i, m->Cbt_w, m->wCbt);
        gather(w->dad, w->da, nba, nf, 3, m->Cbt_i, m->Cbt_w, m->wCbt);
        const real al = m->alpha, be2 = m->beta * m->beta;
        for (idx_t j = 0; j < nba; j++) {
            real acc[TB] = {0};
            for (int c = 0; c < 3; c++) {
                const real dc = p->d0[c * nba + j], ddc = p->dd0[c * nba + j], adc = p->ad0[c * nba + j];
                const real *x = w->dbar0[c * nba + j], *xd = w->ddd[c * nba + j], *xa = w->dad[c * nba + j];
                FOR_B acc[b] += -2 * ddc * xd[b] - (x[b] * adc + dc * xa[b]) - 2 * al * (x[b] * ddc + dc * xd[b])
                                - be2 * dc * x[b];
            }
            memcpy(w->drhs[j], acc, sizeof acc);
        }
        tchord_dA(m, w->dAx, p->lam0, p->d0, w->dbar0, dGc, C);
        for (idx_t j = 0; j < nba; j++) FOR_B w->drhs[j][b] -= w->dAx[j][b];
        tchord_solve(m, p->Ainv, w->dlam, w->drhs);
        tbar_update(m, tg, w, w->da, w->dlam, p->lam0, p->d0, w->dbar0, p->ld0, dPt, 1);   /* (lam0 d0) Pt's */
    }
    for (idx_t r = 0; r < 3 * nf; r++)
        FOR_B {
            dv[r][b] += m->dt * w->da[r][b];
            dq[r][b] += m->dt * dv[r][b];
        }
    if (nba == 0 || m->proj_iters <= 0) return;
    real *yd = p->tmp;                 /* y * d in scalars (3 nba) */
    for (idx_t it = 0; it < m->proj_iters; it++) {
        const real *d = p->dit + it * 3 * nba, *lam = p->lamit + it * nba;
        gather(w->dbar, dq, nba, nf, 3, m->Cbt_i, m->Cbt_w, m->wCbt);
        for (idx_t j = 0; j < nba; j++) {
            real acc[TB] = {0};
            for (int c = 0; c < 3; c++) {
                const real dc = d[c * nba + j];
                const real *x = w->dbar[c * nba + j];
                FOR_B acc[b] += dc * x[b];
            }
            memcpy(w->drhs[j], acc, sizeof acc);
        }
        tchord_dA(m, w->dAx, lam, p->d0, w->dbar0, dGc, C);
        for (idx_t j = 0; j < nba; j++) FOR_B w->drhs[j][b] -= w->dAx[j][b];
        tchord_solve(m, p->Ainv, w->dlam, w->drhs);
        for (int c = 0; c < 3; c++)
            for (idx_t j = 0; j < nba; j++) yd[c * nba + j] = lam[j] * d[c * nba + j];
        tbar_update(m, tg, w, dq, w->dlam, lam, d, w->dbar, yd, dPt, -1);
    }
    gather(w->dbar, dq, nba, nf, 3, m->Cbt_i, m->Cbt_w, m->wCbt);
    gather(w->ddd, dv, nba, nf, 3, m->Cbt_i, m->Cbt_w, m->wCbt);
    for (idx_t j = 0; j < nba; j++) {
        real acc[TB] = {0};
        for (int c = 0; c < 3; c++) {
            const real dc = p->dv[c * nba + j], ddc = p->ddv[c * nba + j];
            const real *x = w->dbar[c * nba + j], *xd = w->ddd[c * nba + j];
            FOR_B acc[b] += x[b] * ddc + dc * xd[b];
        }
        memcpy(w->drhs[j], acc, sizeof acc);
    }
    tchord_dA(m, w->dAx, p->lamv, p->d0, w->dbar0, dGc, C);
    for (idx_t j = 0; j < nba; j++) FOR_B w->drhs[j][b] -= w->dAx[j][b];
    tchord_solve(m, p->Ainv, w->dlam, w->drhs);
    for (int c = 0; c < 3; c++)
        for (idx_t j = 0; j < nba; j++) yd[c * nba + j] = p->lamv[j] * p->dv[c * nba + j];
    tbar_update(m, tg, w, dv, w->dlam, p->lamv, p->dv, w->dbar, yd, dPt, -1);
#undef DT_
}

/* sample h of the state and its tangent tiles: Qs[h] = a q, Ss[h] = a S (first) or += (its second state) */
static void sample_into(const Prim *p, const lane *lm, idx_t nf, idx_t nt, idx_t Cs, idx_t h, real a, int first,
                        real *Qs, real *Ss)
{
    const idx_t n3 = 3 * nf;
    real *q = Qs + h * n3;
    for (idx_t r = 0; r < n3; r++) q[r] = (first ? 0 : q[r]) + a * p->q[r];
    for (idx_t r = 0; r < n3; r++) {
        real *row = Ss + (h * n3 + r) * Cs;
        for (idx_t t = 0; t < nt; t++) {
            const real *x = lm[t * 2 * n3 + r];
            const idx_t l = Cs - t * TB < TB ? Cs - t * TB : TB;
            real *o = row + t * TB;
            if (first) for (idx_t b = 0; b < l; b++) o[b] = a * x[b];
            else for (idx_t b = 0; b < l; b++) o[b] += a * x[b];
        }
    }
}

/* n steps of one item with C directions (the parameters shared: Model.pB == 1).
 * q0, v0 (3 nf); S0q, S0v (3 nf, C): the start and its tangents. u, ud: step k's motor angles and rates at
 * [k * u_sk], (A) each, or NULL; du, dud: step k's tangents at [k * du_sk], (A, P) each, or NULL; fq: step k's
 * reduced external forces at [k * fq_sk], (3 nf), or NULL. The H samples: sample h is (1 - w[h]) state[k0[h]] +
 * w[h] state[min(k0[h] + 1, n)] (k0[h] <= n; state 0 the start, k the state after step k), written to Qs (H, 3 nf) and
 * the first Cs <= C directions to Ss (H, 3 nf, Cs), the layout identification's Jacobian reads, so that nothing is
 * gathered or transposed afterwards. Returns 0, or -1 when out of memory. */
int tangent_rollout(const Model *m, const Tangents *tg, idx_t n, const real *q0, const real *v0, const real *S0q,
                    const real *S0v, const real *u, const real *ud, idx_t u_sk, const real *du, const real *dud,
                    idx_t du_sk, const real *fq, idx_t fq_sk, idx_t H, const idx_t *k0, const real *w1, idx_t Cs,
                    real *Qs, real *Ss)
{
    const idx_t nf = m->nf, nseg = m->nseg, S = m->S, nba = m->nba, C = tg->C, nt = C / TB;
    const idx_t its = m->proj_iters > 0 ? m->proj_iters : 0;
    idx_t ainv_size = 0, mx = 0;
    for (idx_t j = 0; j < m->nblk; j++) {
        const idx_t k = m->blk_ptr[j + 1] - m->blk_ptr[j];
        ainv_size += k * k;
        if (k > mx) mx = k;
    }
    const idx_t big = 3 * nseg > 3 * nf ? 3 * nseg : 3 * nf;
    /* tmp: the forces' segment products (3 nseg), a bar correction's (3 nba + 3 nf), the tangent's y d (3 nba) */
    const idx_t ntmp = big > 3 * nba + 3 * nf ? big : 3 * nba + 3 * nf;
    /* scalars of the primal */
    const size_t np = 2 * 3 * nf + 3 * 3 * nseg + 3 * nseg + 9 * S + ntmp + 3 * 3 * nf + 5 * 3 * nba + 2 * nba
                      + ainv_size + 2 * mx * mx + its * 4 * nba + nba + 3 * nba;
    real *pm = calloc(np, sizeof(real));
    /* lanes: the tangent state (2 * 3 nf per tile) and one tile's work */
    const size_t nw = 3 * 3 * nseg + 3 * nseg + 3 * S + ntmp + 2 * 3 * nf + 5 * 3 * nba + 3 * nba + 3 * nf;
    lane *lm = aligned_alloc(64, (2 * 3 * nf * nt + nw) * sizeof(lane));
    /* the patterns of Minv, Pt and their parameter tangents: pointers (n_out + 1) and rows (n_in n_out) each */
    idx_t *pat = malloc(2 * ((nf + 1) + nf * nf + (nf + 1) + nba * nf) * sizeof(idx_t));
    if (pm == NULL || lm == NULL || pat == NULL) { free(pm); free(lm); free(pat); return -1; }
    Prim p;
    real *x = pm;
#define TAKE(f, k) (p.f = x, x += (k))
    TAKE(q, 3 * nf); TAKE(v, 3 * nf); TAKE(s, 3 * nseg); TAKE(sd, 3 * nseg); TAKE(e, 3 * nseg);
    TAKE(xi, nseg); TAKE(xid, nseg); TAKE(segt, nseg);
    TAKE(len, S); TAKE(ld, S); TAKE(xi0, S); TAKE(xi0d, S); TAKE(D, S); TAKE(Dd, S); TAKE(kap, S); TAKE(act, S);
    TAKE(ten, S);
    TAKE(tmp, ntmp); TAKE(F, 3 * nf); TAKE(a0, 3 * nf); TAKE(a, 3 * nf);
    TAKE(d0, 3 * nba); TAKE(dd0, 3 * nba); TAKE(ad0, 3 * nba); TAKE(dv, 3 * nba); TAKE(ddv, 3 * nba);
    TAKE(lam0, nba); TAKE(rhs, nba); TAKE(Ainv, ainv_size); TAKE(blk, 2 * mx * mx);
    TAKE(dit, its * 3 * nba); TAKE(lamit, its * nba); TAKE(lamv, nba); TAKE(ld0, 3 * nba);
#undef TAKE
    TWork w;
    lane *y = lm + 2 * 3 * nf * nt;
#define TAKE(f, k) (w.f = y, y += (k))
    TAKE(ds, 3 * nseg); TAKE(dsd, 3 * nseg); TAKE(de, 3 * nseg); TAKE(dxi, nseg); TAKE(dxid, nseg);
    TAKE(dsegt, nseg); TAKE(dlen, S); TAKE(dld, S); TAKE(dten, S); TAKE(dtmp, ntmp); TAKE(dF, 3 * nf);
    TAKE(da, 3 * nf); TAKE(dbar0, 3 * nba); TAKE(ddd, 3 * nba); TAKE(dad, 3 * nba); TAKE(wrk, 3 * nba);
    TAKE(dbar, 3 * nba); TAKE(drhs, nba); TAKE(dlam, nba); TAKE(dAx, nba); TAKE(dcor, 3 * nf);
#undef TAKE
    idx_t *pp = pat;
#define PATTERN(f, M, n_in, ld, ncol) \
    (w.f = pattern_of(M, n_in, nf, ld, ncol, pp, pp + nf + 1), pp += nf + 1 + (n_in) * nf)
    PATTERN(Minv, m->Minv, nf, 1, 1); PATTERN(Pt, m->Pt, nba, 1, 1);
    PATTERN(dMinv, tg->dMinv, nf, C, tg->P); PATTERN(dPt, tg->dPt, nba, C, tg->P);
#undef PATTERN
    memcpy(p.q, q0, 3 * nf * sizeof(real));
    memcpy(p.v, v0, 3 * nf * sizeof(real));
    for (idx_t t = 0; t < nt; t++)
        for (idx_t r = 0; r < 3 * nf; r++) {
            lane *tq = lm + t * 2 * 3 * nf, *tv = tq + 3 * nf;
            FOR_B { tq[r][b] = S0q[r * C + t * TB + b]; tv[r][b] = S0v[r * C + t * TB + b]; }
        }
    for (idx_t k = 0;; k++) {
        for (idx_t h = 0; h < H; h++) {                     /* the samples that read the state after step k */
            const idx_t k1 = k0[h] < n ? k0[h] + 1 : n;
            if (k0[h] == k || k1 == k)
                sample_into(&p, lm, nf, nt, Cs, h, (k0[h] == k ? 1 - w1[h] : 0) + (k1 == k ? w1[h] : 0), k0[h] == k,
                            Qs, Ss);
        }
        if (k == n) break;
        const real *uk = u != NULL ? u + k * u_sk : NULL, *udk = u != NULL && ud != NULL ? ud + k * u_sk : NULL;
        pstep(m, &p, uk, udk, fq != NULL ? fq + k * fq_sk : NULL);
        for (idx_t t = 0; t < nt; t++) {
            lane *tq = lm + t * 2 * 3 * nf, *tv = tq + 3 * nf;
            tstep(m, tg, &p, &w, tq, tv, t * TB, uk, udk, du != NULL && uk != NULL ? du + k * du_sk : NULL,
                  dud != NULL && uk != NULL ? dud + k * du_sk : NULL);
        }
    }
    free(pm);
    free(lm);
    free(pat);
    return 0;
}
