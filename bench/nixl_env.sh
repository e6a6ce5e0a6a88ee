# Sourced by the NIXL benchmark scripts: exports TENSORPORT_NIXL (unpacking PyPI's nixl-cu13
# wheel with scripts/fetch-nixl.sh unless it is set) and sets TCP to the UCX_TLS that means "TCP
# only" here: NIXL refuses a list without a CUDA transport on a host with NVIDIA GPUs, so there
# it is "tcp,cuda_copy" (cuda_copy moves only device memory; host tensors still go over TCP).
if [[ -z "${TENSORPORT_NIXL:-}" ]]; then
  TENSORPORT_NIXL=$(dirname "$("$(dirname "${BASH_SOURCE[0]}")/../scripts/fetch-nixl.sh")")/..
fi
export TENSORPORT_NIXL UCX_WARN_UNUSED_ENV_VARS=n
TCP=tcp
if [[ -e /dev/nvidia0 ]]; then TCP=tcp,cuda_copy; fi
