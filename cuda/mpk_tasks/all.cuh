// Every task family; the generated dispatch includes this.
#pragma once
#include "attention.cuh"
#include "data_movement.cuh"
#include "diagnostic.cuh"
#include "gemm.cuh"
#include "linalg.cuh"
#include "paged_attention.cuh"
#include "paged_plan.cuh"
#include "paged_prefill.cuh"
#include "pointwise.cuh"
#include "rows.cuh"
#include "sampling.cuh"
#include "sort.cuh"
