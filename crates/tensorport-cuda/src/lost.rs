//! Which CUDA errors leave a process's context unusable: a kernel's fault (sticky: every later
//! call in that context fails the same way) or the loss of the MPS server the context ran on.
//! No retry in the same process can help; the process must end and a new one start (a farm
//! restarts its servers and producers, and redoes what they had not answered).
//!
//! cudarc reports a driver error by its `CUresult` name or number, ONNX Runtime's CUDA provider
//! by the runtime's number and description: [`context_lost`] recognises each form.

/// One error that ends a context: the driver's `CUresult`, its name, the runtime's name, and
/// the description both APIs print.
struct Lost {
    code: u32,
    driver: &'static str,
    runtime: &'static str,
    says: &'static str,
}

#[rustfmt::skip]
const LOST: &[Lost] = &[
    Lost { code: 214, driver: "CUDA_ERROR_ECC_UNCORRECTABLE", runtime: "cudaErrorECCUncorrectable", says: "uncorrectable ECC error encountered" },
    Lost { code: 700, driver: "CUDA_ERROR_ILLEGAL_ADDRESS", runtime: "cudaErrorIllegalAddress", says: "an illegal memory access was encountered" },
    Lost { code: 702, driver: "CUDA_ERROR_LAUNCH_TIMEOUT", runtime: "cudaErrorLaunchTimeout", says: "the launch timed out and was terminated" },
    Lost { code: 709, driver: "CUDA_ERROR_CONTEXT_IS_DESTROYED", runtime: "cudaErrorContextIsDestroyed", says: "context is destroyed" },
    Lost { code: 714, driver: "CUDA_ERROR_HARDWARE_STACK_ERROR", runtime: "cudaErrorHardwareStackError", says: "hardware stack error" },
    Lost { code: 715, driver: "CUDA_ERROR_ILLEGAL_INSTRUCTION", runtime: "cudaErrorIllegalInstruction", says: "an illegal instruction was encountered" },
    Lost { code: 716, driver: "CUDA_ERROR_MISALIGNED_ADDRESS", runtime: "cudaErrorMisalignedAddress", says: "misaligned address" },
    Lost { code: 717, driver: "CUDA_ERROR_INVALID_ADDRESS_SPACE", runtime: "cudaErrorInvalidAddressSpace", says: "operation not supported on global/shared address space" },
    Lost { code: 718, driver: "CUDA_ERROR_INVALID_PC", runtime: "cudaErrorInvalidPc", says: "invalid program counter" },
    Lost { code: 719, driver: "CUDA_ERROR_LAUNCH_FAILED", runtime: "cudaErrorLaunchFailure", says: "unspecified launch failure" },
    Lost { code: 805, driver: "CUDA_ERROR_MPS_CONNECTION_FAILED", runtime: "cudaErrorMpsConnectionFailed", says: "MPS client failed to connect to the MPS control daemon or the MPS server" },
    Lost { code: 806, driver: "CUDA_ERROR_MPS_RPC_FAILURE", runtime: "cudaErrorMpsRpcFailure", says: "the remote procedural call between the MPS server and the MPS client failed" },
    Lost { code: 807, driver: "CUDA_ERROR_MPS_SERVER_NOT_READY", runtime: "cudaErrorMpsServerNotReady", says: "MPS server is not ready to accept new MPS client requests" },
    Lost { code: 810, driver: "CUDA_ERROR_MPS_CLIENT_TERMINATED", runtime: "cudaErrorMpsClientTerminated", says: "the MPS client has been terminated by the server" },
];

/// Whether the driver's `code` (a `CUresult`) leaves the context unusable.
fn is_lost_code(code: u32) -> bool {
    LOST.iter().any(|l| l.code == code)
}

/// Whether an error's text reports a CUDA error that leaves the context unusable: by the
/// driver's name (`CUDA_ERROR_ILLEGAL_ADDRESS`), the runtime's (`cudaErrorIllegalAddress`), a
/// number after `CUresult`, `CUDA failure` or `CUDA error`, or the description the driver
/// prints.
pub fn context_lost(message: &str) -> bool {
    LOST.iter().any(|l| {
        message.contains(l.driver) || message.contains(l.runtime) || message.contains(l.says)
    }) || numbers_after(message, &["CUresult ", "CUDA failure ", "CUDA error "]).any(is_lost_code)
}

/// The numbers that follow each of `marks` in `text`.
fn numbers_after<'a>(text: &'a str, marks: &'a [&'a str]) -> impl Iterator<Item = u32> + 'a {
    marks.iter().flat_map(move |mark| {
        text.match_indices(mark).filter_map(move |(at, m)| {
            let rest = &text[at + m.len()..];
            let digits = rest
                .find(|c: char| !c.is_ascii_digit())
                .unwrap_or(rest.len());
            rest[..digits].parse().ok()
        })
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_form_of_a_lost_context_is_recognised() {
        for text in [
            // cudarc, through a model's error
            r#"device error: Driver(DriverError(CUDA_ERROR_MPS_RPC_FAILURE, "the remote procedural call between the MPS server and the MPS client failed"))"#,
            // this crate's driver wrappers
            "cuStreamSynchronize failed: an illegal memory access was encountered (CUresult 700)",
            "cuMemcpyHtoDAsync failed: something new (CUresult 719)",
            // ONNX Runtime's CUDA provider
            "CUDA failure 806: the remote procedural call ... ; GPU=0 ; expr=cudaStreamSynchronize(s);",
            "CUDA error cudaErrorLaunchFailure:unspecified launch failure",
            "CUDA error 810",
        ] {
            assert!(context_lost(text), "{text}");
        }
    }

    #[test]
    fn errors_a_context_survives_are_not_taken_for_lost() {
        for text in [
            "cuMemAlloc failed: out of memory (CUresult 2)",
            "CUDA failure 2: out of memory ; GPU=0",
            "CUDA error 7000",
            "CUresult 70",
            "a batch with no device memory",
            // too many clients: a restart would meet the same limit
            "CUDA_ERROR_MPS_MAX_CLIENTS_REACHED",
            "",
        ] {
            assert!(!context_lost(text), "{text}");
        }
        assert!(is_lost_code(700) && !is_lost_code(2));
    }
}
