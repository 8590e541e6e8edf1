//! Entry points the runtimes resolve that this device does not offer yet:
//! each returns CUDA_ERROR_NOT_SUPPORTED and logs its name (with
//! `VGPU_LOG`), never crashes. docs/cuda-stacks.md lists what is missing.
//!
//! Every stub takes no arguments: under the C calling convention a callee
//! that reads none of its arguments is safe to call with any.

use super::{fail, CUresult};
use crate::client::CallError;
use virtio_gpu_compute::CuResult;

fn unsupported(name: &str) -> CUresult {
    fail(name, CallError::new(CuResult::CUDA_ERROR_NOT_SUPPORTED, "this entry point is not supported on this device"))
}

macro_rules! stubs {
    ($($name:ident),* $(,)?) => {
        $(
            #[no_mangle]
            pub extern "C" fn $name() -> CUresult {
                unsupported(stringify!($name))
            }
        )*

        /// The stub for a base name, if it has one.
        pub(super) fn lookup(name: &str) -> Option<*mut std::ffi::c_void> {
            match name {
                $(stringify!($name) => Some($name as *const () as *mut std::ffi::c_void),)*
                _ => None,
            }
        }
    };
}

stubs! {
    cuArray3DCreate, cuArray3DGetDescriptor, cuArrayCreate,
    cuArrayDestroy, cuArrayGetDescriptor, cuArrayGetMemoryRequirements, cuArrayGetPlane,
    cuArrayGetSparseProperties, cuCheckpointProcessCheckpoint, cuCheckpointProcessGetRestoreThreadId, cuCheckpointProcessGetState,
    cuCheckpointProcessLock, cuCheckpointProcessRestore, cuCheckpointProcessUnlock, cuCoredumpGetAttribute,
    cuCoredumpGetAttributeGlobal, cuCoredumpSetAttribute, cuCoredumpSetAttributeGlobal, cuCtxAttach,
    cuCtxDetach, cuCtxDisablePeerAccess, cuCtxEnablePeerAccess, cuCtxFromGreenCtx,
    cuCtxGetDevResource, cuCtxGetExecAffinity, cuCtxRecordEvent, cuCtxWaitEvent,
    cuDestroyExternalMemory, cuDestroyExternalSemaphore, cuDevResourceGenerateDesc, cuDevSmResourceSplitByCount,
    cuDeviceGetDevResource, cuDeviceGetExecAffinitySupport, cuDeviceGetGraphMemAttribute,
    cuDeviceGetLuid, cuDeviceGetNvSciSyncAttributes, cuDeviceGetTexture1DLinearMaxWidth,
    cuDeviceGraphMemTrim, cuDeviceRegisterAsyncNotification, cuDeviceSetGraphMemAttribute, cuDeviceUnregisterAsyncNotification, cuEGLStreamConsumerAcquireFrame, cuEGLStreamConsumerConnect, cuEGLStreamConsumerConnectWithFlags,
    cuEGLStreamConsumerDisconnect, cuEGLStreamConsumerReleaseFrame, cuEGLStreamProducerConnect, cuEGLStreamProducerDisconnect,
    cuEGLStreamProducerPresentFrame, cuEGLStreamProducerReturnFrame, cuEventCreateFromEGLSync, cuExternalMemoryGetMappedBuffer,
    cuExternalMemoryGetMappedMipmappedArray, cuFlushGPUDirectRDMAWrites, cuFuncSetBlockShape, cuFuncSetSharedSize,
    cuGLCtxCreate, cuGLGetDevices, cuGLInit, cuGLMapBufferObject,
    cuGLMapBufferObjectAsync, cuGLRegisterBufferObject, cuGLSetBufferObjectMapFlags, cuGLUnmapBufferObject,
    cuGLUnmapBufferObjectAsync, cuGLUnregisterBufferObject, cuGraphAddBatchMemOpNode, cuGraphAddChildGraphNode,
    cuGraphAddDependencies, cuGraphAddEmptyNode, cuGraphAddEventRecordNode, cuGraphAddEventWaitNode,
    cuGraphAddExternalSemaphoresSignalNode, cuGraphAddExternalSemaphoresWaitNode, cuGraphAddHostNode, cuGraphAddKernelNode,
    cuGraphAddMemAllocNode, cuGraphAddMemFreeNode, cuGraphAddMemcpyNode, cuGraphAddMemsetNode,
    cuGraphAddNode, cuGraphBatchMemOpNodeGetParams, cuGraphBatchMemOpNodeSetParams, cuGraphChildGraphNodeGetGraph,
    cuGraphClone, cuGraphConditionalHandleCreate, cuGraphDebugDotPrint,
    cuGraphDestroyNode, cuGraphEventRecordNodeGetEvent, cuGraphEventRecordNodeSetEvent,
    cuGraphEventWaitNodeGetEvent, cuGraphEventWaitNodeSetEvent, cuGraphExecBatchMemOpNodeSetParams, cuGraphExecChildGraphNodeSetParams,
    cuGraphExecEventRecordNodeSetEvent, cuGraphExecEventWaitNodeSetEvent, cuGraphExecExternalSemaphoresSignalNodeSetParams,
    cuGraphExecExternalSemaphoresWaitNodeSetParams, cuGraphExecHostNodeSetParams, cuGraphExecKernelNodeSetParams,
    cuGraphExecMemcpyNodeSetParams, cuGraphExecMemsetNodeSetParams, cuGraphExecNodeSetParams, cuGraphExecUpdate,
    cuGraphExternalSemaphoresSignalNodeGetParams, cuGraphExternalSemaphoresSignalNodeSetParams, cuGraphExternalSemaphoresWaitNodeGetParams, cuGraphExternalSemaphoresWaitNodeSetParams,
    cuGraphGetEdges, cuGraphGetRootNodes, cuGraphHostNodeGetParams,
    cuGraphHostNodeSetParams,
    cuGraphKernelNodeCopyAttributes, cuGraphKernelNodeGetAttribute, cuGraphKernelNodeGetParams, cuGraphKernelNodeSetAttribute,
    cuGraphKernelNodeSetParams, cuGraphMemAllocNodeGetParams, cuGraphMemFreeNodeGetParams,
    cuGraphMemcpyNodeGetParams, cuGraphMemcpyNodeSetParams, cuGraphMemsetNodeGetParams, cuGraphMemsetNodeSetParams,
    cuGraphNodeFindInClone, cuGraphNodeGetDependencies, cuGraphNodeGetDependentNodes, cuGraphNodeGetEnabled,
    cuGraphNodeGetType, cuGraphNodeSetEnabled, cuGraphNodeSetParams, cuGraphReleaseUserObject,
    cuGraphRemoveDependencies, cuGraphRetainUserObject, cuGraphicsEGLRegisterImage,
    cuGraphicsGLRegisterBuffer, cuGraphicsGLRegisterImage, cuGraphicsMapResources, cuGraphicsResourceGetMappedEglFrame,
    cuGraphicsResourceGetMappedMipmappedArray, cuGraphicsResourceGetMappedPointer, cuGraphicsResourceSetMapFlags, cuGraphicsSubResourceGetMappedArray,
    cuGraphicsUnmapResources, cuGraphicsUnregisterResource, cuGraphicsVDPAURegisterOutputSurface, cuGraphicsVDPAURegisterVideoSurface,
    cuGreenCtxCreate, cuGreenCtxDestroy, cuGreenCtxGetDevResource, cuGreenCtxGetId, cuGreenCtxRecordEvent,
    cuDeviceGetHostAtomicCapabilities, cuDeviceGetP2PAtomicCapabilities, cuMemPrefetchBatchAsync,
    cuMemDiscardBatchAsync, cuMemDiscardAndPrefetchBatchAsync,
    cuGreenCtxStreamCreate, cuGreenCtxWaitEvent, cuImportExternalMemory, cuImportExternalSemaphore,
    cuIpcCloseMemHandle, cuIpcGetEventHandle, cuIpcGetMemHandle, cuIpcOpenEventHandle,
    cuIpcOpenMemHandle, cuLaunch, cuLaunchCooperativeKernelMultiDevice, cuLaunchGrid,
    cuLaunchGridAsync, cuLibraryGetManaged, cuLibraryGetUnifiedFunction, cuLogsCurrent,
    cuLogsDumpToFile, cuLogsDumpToMemory, cuLogsRegisterCallback, cuLogsUnregisterCallback,
    cuMemAddressFree, cuMemAddressReserve, cuMemAdvise, cuMemAllocManaged, cuMemBatchDecompressAsync, cuMemCreate,
    cuMemExportToShareableHandle, cuMemGetAccess, cuMemGetAllocationGranularity,
    cuMemGetAllocationPropertiesFromHandle, cuMemGetHandleForAddressRange, cuMemImportFromShareableHandle, cuMemMap,
    cuMemMapArrayAsync, cuMemPoolExportPointer,
    cuMemPoolExportToShareableHandle, cuMemPoolImportFromShareableHandle,
    cuMemPoolImportPointer, cuMemPrefetchAsync, cuMemRangeGetAttribute, cuMemRangeGetAttributes, cuMemRelease,
    cuMemRetainAllocationHandle, cuMemSetAccess, cuMemUnmap, cuMemcpy3DBatchAsync,
    cuMemcpy3DPeer, cuMemcpy3DPeerAsync, cuMemcpyAtoA, cuMemcpyAtoD,
    cuMemcpyAtoH, cuMemcpyAtoHAsync, cuMemcpyBatchAsync, cuMemcpyDtoA,
    cuMemcpyHtoA, cuMemcpyHtoAAsync, cuMipmappedArrayCreate, cuMipmappedArrayDestroy,
    cuMipmappedArrayGetLevel, cuMipmappedArrayGetMemoryRequirements, cuMipmappedArrayGetSparseProperties, cuModuleGetSurfRef,
    cuModuleGetTexRef, cuMulticastAddDevice, cuMulticastBindAddr, cuMulticastBindMem,
    cuMulticastCreate, cuMulticastGetGranularity, cuMulticastUnbind, cuOccupancyMaxActiveClusters,
    cuOccupancyMaxPotentialClusterSize, cuParamSetSize, cuParamSetTexRef, cuParamSetf,
    cuParamSeti, cuParamSetv, cuSignalExternalSemaphoresAsync, cuStreamAttachMemAsync,
    cuStreamBatchMemOp, cuStreamBeginCaptureToGraph, cuStreamCopyAttributes,
    cuStreamGetAttribute, cuStreamGetGreenCtx, cuStreamSetAttribute, cuStreamUpdateCaptureDependencies,
    cuStreamWaitValue32, cuStreamWaitValue64, cuStreamWriteValue32, cuStreamWriteValue64,
    cuSurfObjectCreate, cuSurfObjectDestroy, cuSurfObjectGetResourceDesc, cuSurfRefGetArray,
    cuSurfRefSetArray, cuTensorMapEncodeIm2col, cuTensorMapEncodeIm2colWide, cuTensorMapEncodeTiled,
    cuTensorMapReplaceAddress, cuTexObjectCreate, cuTexObjectDestroy, cuTexObjectGetResourceDesc,
    cuTexObjectGetResourceViewDesc, cuTexObjectGetTextureDesc, cuTexRefCreate, cuTexRefDestroy,
    cuTexRefGetAddress, cuTexRefGetAddressMode, cuTexRefGetArray, cuTexRefGetBorderColor,
    cuTexRefGetFilterMode, cuTexRefGetFlags, cuTexRefGetFormat, cuTexRefGetMaxAnisotropy,
    cuTexRefGetMipmapFilterMode, cuTexRefGetMipmapLevelBias, cuTexRefGetMipmapLevelClamp, cuTexRefGetMipmappedArray,
    cuTexRefSetAddress, cuTexRefSetAddress2D, cuTexRefSetAddressMode, cuTexRefSetArray,
    cuTexRefSetBorderColor, cuTexRefSetFilterMode, cuTexRefSetFlags, cuTexRefSetFormat,
    cuTexRefSetMaxAnisotropy, cuTexRefSetMipmapFilterMode, cuTexRefSetMipmapLevelBias, cuTexRefSetMipmapLevelClamp,
    cuTexRefSetMipmappedArray, cuUserObjectCreate, cuUserObjectRelease, cuUserObjectRetain,
    cuVDPAUCtxCreate, cuVDPAUGetDevice, cuWaitExternalSemaphoresAsync,
}
