// Which kernels a build holds, from the target's instruction sets (gcc's -march), decided in one place.
#ifndef SLIMLM_CPU_ISA_H
#define SLIMLM_CPU_ISA_H

// The bf16 GEMM (cpu_gemm.c) needs the bf16 dot product (AVX-512 BF16) and VBMI's byte permute, which gathers
// 4-bit codes into pairs. Cooper Lake has the first without the second: it runs the AVX-512 fp32 loops, as
// AVX-512 CPUs without BF16 do.
#if defined(__AVX512BF16__) && defined(__AVX512VBMI__)
#define SLIMLM_BF16_GEMM 1
#endif

#endif
