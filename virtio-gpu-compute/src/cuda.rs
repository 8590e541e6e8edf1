//! CUDA Driver API result codes. Numeric values are CUDA's, so a reply's
//! status can be handed to an unmodified program as a `CUresult`.

macro_rules! cuda_results {
    ($($name:ident = $val:expr, $text:expr;)*) => {
        /// A `CUresult`: the status carried in every reply header.
        #[allow(non_camel_case_types)]
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
        #[repr(u32)]
        pub enum CuResult { $($name = $val),* }

        impl CuResult {
            /// Maps a raw code; unknown codes become `CUDA_ERROR_UNKNOWN`.
            pub fn from_u32(v: u32) -> CuResult {
                match v { $($val => CuResult::$name,)* _ => CuResult::CUDA_ERROR_UNKNOWN }
            }
            /// Whether `v` is a code this crate knows.
            pub fn is_known(v: u32) -> bool {
                matches!(v, $($val)|*)
            }
            /// The enumerator name, as `cuGetErrorName` returns it.
            pub fn name(self) -> &'static str {
                match self { $(CuResult::$name => stringify!($name)),* }
            }
            /// A short description, as `cuGetErrorString` returns it.
            pub fn description(self) -> &'static str {
                match self { $(CuResult::$name => $text),* }
            }
            /// NUL-terminated name for the C ABI.
            pub fn name_c(self) -> &'static [u8] {
                match self { $(CuResult::$name => concat!(stringify!($name), "\0").as_bytes()),* }
            }
            /// NUL-terminated description for the C ABI.
            pub fn description_c(self) -> &'static [u8] {
                match self { $(CuResult::$name => concat!($text, "\0").as_bytes()),* }
            }
        }
    };
}

cuda_results! {
    CUDA_SUCCESS = 0, "no error";
    CUDA_ERROR_INVALID_VALUE = 1, "invalid argument";
    CUDA_ERROR_OUT_OF_MEMORY = 2, "out of memory";
    CUDA_ERROR_NOT_INITIALIZED = 3, "initialization error";
    CUDA_ERROR_DEINITIALIZED = 4, "driver shutting down";
    CUDA_ERROR_PROFILER_DISABLED = 5, "profiler disabled while using external profiling tool";
    CUDA_ERROR_STUB_LIBRARY = 34, "CUDA driver is a stub library";
    CUDA_ERROR_DEVICE_UNAVAILABLE = 46, "device unavailable";
    CUDA_ERROR_NO_DEVICE = 100, "no CUDA-capable device is detected";
    CUDA_ERROR_INVALID_DEVICE = 101, "invalid device ordinal";
    CUDA_ERROR_INVALID_IMAGE = 200, "device kernel image is invalid";
    CUDA_ERROR_INVALID_CONTEXT = 201, "invalid device context";
    CUDA_ERROR_CONTEXT_ALREADY_CURRENT = 202, "context already current";
    CUDA_ERROR_NOT_MAPPED = 211, "resource not mapped";
    CUDA_ERROR_NO_BINARY_FOR_GPU = 209, "no kernel image is available for execution on the device";
    CUDA_ERROR_UNSUPPORTED_LIMIT = 215, "limit is not supported on this architecture";
    CUDA_ERROR_PEER_ACCESS_UNSUPPORTED = 217, "peer access is not supported between these two devices";
    CUDA_ERROR_INVALID_PTX = 218, "a PTX JIT compilation failed";
    CUDA_ERROR_JIT_COMPILER_NOT_FOUND = 221, "PTX JIT compiler library not found";
    CUDA_ERROR_UNSUPPORTED_PTX_VERSION = 222, "the provided PTX was compiled with an unsupported toolchain";
    CUDA_ERROR_INVALID_SOURCE = 300, "device kernel image is invalid";
    CUDA_ERROR_FILE_NOT_FOUND = 301, "file not found";
    CUDA_ERROR_OPERATING_SYSTEM = 304, "OS call failed or operation not supported on this OS";
    CUDA_ERROR_INVALID_HANDLE = 400, "invalid resource handle";
    CUDA_ERROR_ILLEGAL_STATE = 401, "the operation is not permitted in the current state";
    CUDA_ERROR_NOT_FOUND = 500, "named symbol not found";
    CUDA_ERROR_NOT_READY = 600, "device not ready";
    CUDA_ERROR_ILLEGAL_ADDRESS = 700, "an illegal memory access was encountered";
    CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES = 701, "too many resources requested for launch";
    CUDA_ERROR_LAUNCH_TIMEOUT = 702, "the launch timed out and was terminated";
    CUDA_ERROR_ASSERT = 710, "device-side assert triggered";
    CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED = 712, "part or all of the requested memory range is already mapped";
    CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED = 713, "pointer does not correspond to a registered memory region";
    CUDA_ERROR_ILLEGAL_INSTRUCTION = 715, "an illegal instruction was encountered";
    CUDA_ERROR_CONTEXT_IS_DESTROYED = 709, "context is destroyed";
    CUDA_ERROR_MISALIGNED_ADDRESS = 716, "misaligned address";
    CUDA_ERROR_LAUNCH_FAILED = 719, "unspecified launch failure";
    CUDA_ERROR_COOPERATIVE_LAUNCH_TOO_LARGE = 720, "too many blocks in cooperative launch";
    CUDA_ERROR_NOT_PERMITTED = 800, "operation not permitted";
    CUDA_ERROR_NOT_SUPPORTED = 801, "operation not supported";
    CUDA_ERROR_MPS_CONNECTION_FAILED = 805, "MPS client failed to connect to the MPS control daemon or the MPS server";
    CUDA_ERROR_MPS_RPC_FAILURE = 806, "the remote procedural call between the MPS server and the MPS client failed";
    CUDA_ERROR_MPS_SERVER_NOT_READY = 807, "MPS server is not ready to accept new MPS client requests";
    CUDA_ERROR_MPS_MAX_CLIENTS_REACHED = 808, "the hardware resources required to create MPS client have been exhausted";
    CUDA_ERROR_MPS_MAX_CONNECTIONS_REACHED = 809, "the hardware resources required to support device connections have been exhausted";
    CUDA_ERROR_MPS_CLIENT_TERMINATED = 810, "the MPS client has been terminated by the server";
    CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED = 900, "operation not permitted when stream is capturing";
    CUDA_ERROR_STREAM_CAPTURE_INVALIDATED = 901, "operation failed due to a previous error during capture";
    CUDA_ERROR_STREAM_CAPTURE_UNMATCHED = 903, "capture was not ended in the same stream as it began";
    CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD = 908, "attempt to terminate a thread-local capture sequence from another thread";
    CUDA_ERROR_UNKNOWN = 999, "unknown error";
}

impl CuResult {
    pub fn is_ok(self) -> bool {
        self == CuResult::CUDA_SUCCESS
    }

    /// Errors that leave a context unusable, as on a real GPU: every later
    /// call on it returns the same error.
    pub fn is_sticky(self) -> bool {
        matches!(
            self,
            CuResult::CUDA_ERROR_ILLEGAL_ADDRESS
                | CuResult::CUDA_ERROR_MISALIGNED_ADDRESS
                | CuResult::CUDA_ERROR_LAUNCH_TIMEOUT
                | CuResult::CUDA_ERROR_ASSERT
                | CuResult::CUDA_ERROR_ILLEGAL_INSTRUCTION
                | CuResult::CUDA_ERROR_LAUNCH_FAILED
        )
    }
}

impl std::fmt::Display for CuResult {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} ({})", self.name(), *self as u32)
    }
}
