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
