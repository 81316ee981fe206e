/*
 * memfit core: checkpoint planner.
 *
 * Memory model (single-level recomputation). A chain of n stages; stage i has
 *   input_bytes[i]  the tensor handed to it,
 *   saved_bytes[i]  everything its backward needs when it is not checkpointed,
 *   forward_cost[i] its forward time or FLOPs (any non-negative unit).
 * A plan splits [0, n) into contiguous segments, each either stored (its stages
 * keep their saved tensors) or checkpointed (only input_bytes[start] is kept; the
 * segment's stages run again during backward). For a plan,
 *   memory = sum of input_bytes[start] over checkpointed segments
 *          + sum of saved_bytes over stored stages
 *          + max over checkpointed segments of (sum of saved_bytes in it)
 *            (the segment being recomputed; 0 when none is checkpointed),
 *   recompute cost = sum of forward_cost over checkpointed stages.
 * The model is an upper bound on the real peak: while segment k is recomputed,
 * the segments after it have already been freed.
 *
 * A plan is written as n_segments entries of seg_end[] (exclusive end of each
 * segment, increasing, the last one is n; segment j starts at seg_end[j-1], or 0)
 * and seg_ckpt[] (1 when the segment is checkpointed). Output arrays have room
 * for n entries (a plan never has more segments than stages).
 */
#ifndef MEMFIT_PLAN_H
#define MEMFIT_PLAN_H

#include "memfit/common.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct {
  int64_t n_segments;
  int64_t memory_bytes;   /* the plan's memory under the model above, in bytes  */
  double recompute_cost;  /* sum of forward_cost over checkpointed stages        */
  int64_t unit_bytes;     /* memory granularity the dynamic program worked in    */
  int exact;              /* 1: provably least cost; 0: least cost for sizes
                             rounded up to unit_bytes (the plan still fits)      */
} mf_plan_info;

/* Least-recompute-cost plan whose memory is <= budget_bytes (ties: least memory).
 * max_slots bounds the size of the memory axis of the dynamic program (0: auto).
 * When every size is a multiple of a unit with budget/unit <= max_slots (true for
 * chains of identical blocks), the answer is exact; otherwise sizes are rounded up
 * to a coarser unit and info->exact is 0.
 * Fails with MF_ERR_VALUE naming the smallest feasible budget when none fits. */
mf_status mf_plan_budget(int64_t n, const int64_t *input_bytes,
                         const int64_t *saved_bytes, const double *forward_cost,
                         int64_t budget_bytes, int64_t max_slots, int64_t *seg_end,
                         uint8_t *seg_ckpt, mf_plan_info *info);

/* The smallest memory (bytes) of any plan: the least budget mf_plan_budget accepts.
 * Exact, whatever the sizes. */
mf_status mf_plan_min_budget(int64_t n, const int64_t *input_bytes,
                             const int64_t *saved_bytes, int64_t *min_budget_bytes);

/* The classic sqrt(n) plan (Chen et al. 2016): k = round(sqrt(n)) segments of
 * near-equal length; all but the last are checkpointed, the last is stored (its
 * backward runs right after its forward, so recomputing it would save nothing),
 * as torch.utils.checkpoint.checkpoint_sequential does. */
mf_status mf_plan_sqrt(int64_t n, int64_t *seg_end, uint8_t *seg_ckpt,
                       int64_t *n_segments);

/* Checks a plan (segments cover [0, n) in order) and computes its memory and cost
 * under the model. forward_cost may be NULL (cost is then reported as 0). */
mf_status mf_plan_evaluate(int64_t n, const int64_t *input_bytes,
                           const int64_t *saved_bytes, const double *forward_cost,
                           int64_t n_segments, const int64_t *seg_end,
                           const uint8_t *seg_ckpt, int64_t *memory_bytes,
                           double *recompute_cost);

#ifdef __cplusplus
}
#endif
#endif /* MEMFIT_PLAN_H */
