"""fusedlayer.aio: the asyncio client (grpc.aio), with the methods of fusedlayer.Client as coroutines.

    import asyncio, fusedlayer.aio
    async def main():
        async with fusedlayer.aio.AsyncClient("localhost:50051") as c:
            a, b = await asyncio.gather(c.mhc_seam("v41-flash/demo", x1, stage="first"),
                                        c.mhc_seam("v41-flash/demo", x2, stage="first"))
    asyncio.run(main())

Requests are built and responses decoded by the same functions as the synchronous client (numpy or
torch arrays, ExecutionReport, ...), and a failed call raises the same fusedlayer exception classes
with the same ``.code``: DeadlineExceeded for a deadline (``timeout=``), Cancelled for an RPC
cancelled under it (the channel closed while a call was in flight), and so on. Cancelling the task
that awaits a call cancels the RPC and raises asyncio.CancelledError, as for any coroutine.

Create the client inside the event loop that uses it (grpc.aio channels belong to one loop).
transport="shm" is not available here (its shared-memory object is used one call at a time; use the
synchronous client); CUDA torch tensors go by CUDA shared memory as with the synchronous client.
"""

import asyncio
import itertools
import os
import time
from types import TracebackType
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple, Type

import grpc
import grpc.aio

from . import _torch, errors, weights
from ._health.v1 import health_pb2
from .client import (_MHC_INPUT_TYPES, Array, ConfigEntry, MhcSeamResult, OpenedResidualSession, ServerInfo,
                     SwaNormQuantResult, TlsArg, WeightSetInfo, WeightSource, _channel_args, _commit_failed,
                     _cuda_inputs, _cuda_prepare, _health_status, _in_manifest_order, _manifest_path, _metadata,
                     _mhc_cuda_shapes, _mhc_request, _mhc_result, _open_session_request, _opened_session,
                     _packed_sets, _plain_dict, _pool_size, _remember_configs, _server_info, _stage_id,
                     _swa_cuda_shapes, _swa_request, _swa_result, _upload_failed, _weight_chunks, _weight_set_info)
from .v1 import fusedlayer_pb2 as pb
from .v1 import fusedlayer_pb2_grpc as pb_grpc

__all__ = ["AsyncClient"]


class AsyncClient:
    """An asyncio connection to one fusedlayer server; arguments as fusedlayer.Client (transport "tcp").

    connections / expected_concurrency: as for fusedlayer.Client, the calls spread round robin over
    that many channels, each with a connection of its own (for asyncio.gather of many large calls).
    """

    def __init__(self, target: str, tls: TlsArg = None, token_file: Optional[str] = None, transport: str = "tcp",
                 timeout: Optional[float] = 60.0, max_message_bytes: int = 1 << 30,
                 options: Sequence[Tuple[str, Any]] = (), connections: int = 0,
                 expected_concurrency: int = 1) -> None:
        if transport != "tcp":
            raise ValueError(f"transport = {transport!r} is not available in fusedlayer.aio (only \"tcp\"; the "
                             "synchronous fusedlayer.Client has \"shm\")")
        if not target:
            raise ValueError("target is empty (expected host:port)")
        self.target = target
        self.transport = transport
        self.timeout = timeout
        self._metadata = _metadata(target, tls, token_file)
        self._configs: Dict[str, ConfigEntry] = {}
        self._cuda_regions = _torch.CudaRegions(f"py-aio-cuda-{os.getpid()}-{id(self):x}")
        self._cuda_enabled: Optional[bool] = None
        self._cuda_lock = asyncio.Lock()
        pool = _pool_size(target, connections, expected_concurrency)
        credentials, channel_options = _channel_args(tls, max_message_bytes, options, pool)
        if credentials is not None:
            self._channels = [grpc.aio.secure_channel(target, credentials, options=channel_options)
                              for _ in range(pool)]
        else:
            self._channels = [grpc.aio.insecure_channel(target, options=channel_options) for _ in range(pool)]
        self._stubs = [pb_grpc.FusedLayerStub(channel) for channel in self._channels]
        self._health_checks = [channel.unary_unary(
            "/grpc.health.v1.Health/Check", request_serializer=health_pb2.HealthCheckRequest.SerializeToString,
            response_deserializer=health_pb2.HealthCheckResponse.FromString) for channel in self._channels]
        self._turns = itertools.count()

    @property
    def connections(self) -> int:
        """How many connections (channels) the calls are spread over."""
        return len(self._channels)

    def _member(self) -> int:
        """The index of the channel the next call uses, round robin."""
        return 0 if len(self._channels) == 1 else next(self._turns) % len(self._channels)

    @property
    def _stub(self) -> pb_grpc.FusedLayerStub:
        return self._stubs[self._member()]

    @property
    def _health_check(self) -> Callable[..., Any]:
        return self._health_checks[self._member()]

    async def close(self) -> None:
        for name in self._cuda_regions.names():
            try:
                await self.unregister_cuda_shared_memory(name)
            except errors.FusedLayerError:
                pass  # the server is gone or forgot it
        self._cuda_regions.clear()
        for channel in self._channels:
            await channel.close()

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, exc_type: Optional[Type[BaseException]], exc: Optional[BaseException],
                        tb: Optional[TracebackType]) -> None:
        await self.close()

    async def _call(self, method: Callable[..., Any], request: Any, timeout: Optional[float]) -> Any:
        try:
            return await method(request, timeout=self.timeout if timeout is None else timeout,
                                metadata=self._metadata)
        except grpc.aio.AioRpcError as e:
            raise errors.from_rpc_error(e) from None
        except asyncio.CancelledError:
            # grpc.aio raises CancelledError for an RPC cancelled on this side, whether the awaiting task
            # was cancelled (that stays a CancelledError) or the RPC was cancelled under it: its channel
            # closed while it was in flight (CANCELLED, as the synchronous client reports it).
            task = asyncio.current_task()
            cancelling = getattr(task, "cancelling", None)  # Python >= 3.11
            if task is not None and cancelling is not None and cancelling() == 0:
                raise errors.Cancelled(grpc.StatusCode.CANCELLED, "the call was cancelled before it completed "
                                       "(its channel was closed while it was in flight)") from None
            raise

    async def _config(self, weight_set: str) -> ConfigEntry:
        if weight_set not in self._configs:
            return _remember_configs(self._configs, await self.list_weight_sets(), weight_set)
        return self._configs[weight_set]

    async def _cuda_call(self, method: Callable[..., Any], req: Any, cuda: Dict[str, Tuple[Any, Any]],
                         shapes: Dict[str, Tuple[int, ...]],
                         timeout: Optional[float]) -> Tuple[Any, float, Dict[str, Any]]:
        async with self._cuda_lock:
            if self._cuda_enabled is None:
                self._cuda_enabled = (await self.server_info(timeout)).cuda_shared_memory_enabled
            registrations, placed = _cuda_prepare(self._cuda_regions, self._cuda_enabled, self.target, req, cuda,
                                                  shapes)
            for reg in registrations:
                try:
                    await self.register_cuda_shared_memory(*reg, timeout=timeout)
                except errors.FusedLayerError:
                    self._cuda_regions.forget(reg[0])
                    raise
        start = time.perf_counter()
        r = await self._call(method, req, timeout)
        return r, time.perf_counter() - start, placed

    # ---- ops (fusedlayer.Client documents the arguments) ----------------------------------------

    async def mhc_seam(self, weight_set: str, x: Array, residual: Optional[Array] = None,
                       post_mix: Optional[Array] = None, comb_mix: Optional[Array] = None,
                       pre_mix: Optional[Array] = None, mode: str = "shifted", stage: str = "seam", path: str = "auto",
                       capture_aux: bool = False, verify: bool = False, request_id: str = "",
                       timeout: Optional[float] = None, session: str = "", return_state: bool = False,
                       output: Optional[str] = None, device_id: Optional[int] = None) -> MhcSeamResult:
        """One mHC seam: fusedlayer.Client.mhc_seam as a coroutine."""
        inputs = dict(x=x, residual=residual, post_mix=post_mix, comb_mix=comb_mix, pre_mix=pre_mix)
        kind = _torch.output_kind(output, inputs.values())
        req = _mhc_request(weight_set, inputs, mode, stage, path, capture_aux, verify, request_id, session,
                           return_state, device_id)
        cuda = _cuda_inputs(inputs, dict(_MHC_INPUT_TYPES))
        if cuda:
            shapes = _mhc_cuda_shapes(req, cuda, await self._config(weight_set), capture_aux)
            r, elapsed, placed = await self._cuda_call(self._stub.MhcSeam, req, cuda, shapes, timeout)
            return _mhc_result(r, elapsed, kind, placed)
        start = time.perf_counter()
        r = await self._call(self._stub.MhcSeam, req, timeout)
        return _mhc_result(r, time.perf_counter() - start, kind)

    async def swa_norm_quant(self, weight_set: str, qr_kv: Array, path: str = "auto", verify: bool = False,
                             request_id: str = "", timeout: Optional[float] = None,
                             output: Optional[str] = None, device_id: Optional[int] = None) -> SwaNormQuantResult:
        """SWA norm+quant: fusedlayer.Client.swa_norm_quant as a coroutine."""
        kind = _torch.output_kind(output, [qr_kv])
        req = _swa_request(weight_set, qr_kv, path, verify, request_id, device_id)
        cuda = _cuda_inputs({"qr_kv": qr_kv}, {"qr_kv": pb.DATA_TYPE_BF16})
        if cuda:
            shapes = _swa_cuda_shapes(req, cuda, await self._config(weight_set))
            r, elapsed, placed = await self._cuda_call(self._stub.SwaNormQuant, req, cuda, shapes, timeout)
            return _swa_result(r, elapsed, kind, placed)
        start = time.perf_counter()
        r = await self._call(self._stub.SwaNormQuant, req, timeout)
        return _swa_result(r, time.perf_counter() - start, kind)

    # ---- weights -----------------------------------------------------------------------------

    async def load_weights(self, source: WeightSource, name: Optional[str] = None,
                           mhc: Optional[Mapping[str, Any]] = None, swa: Optional[Mapping[str, Any]] = None,
                           replace: bool = False, timeout: Optional[float] = None) -> List[WeightSetInfo]:
        """fusedlayer.Client.load_weights as a coroutine (every set packed before the first is sent; a
        manifest's sets staged under one stage id and published by one CommitWeightSets, all or none)."""
        packed = _packed_sets(source, name, mhc, swa, replace)
        manifest = _manifest_path(source)
        if manifest is None:
            return [await self.upload(p, timeout) for p in packed]
        stage = _stage_id()
        try:
            for p in packed:
                try:
                    await self.upload(p, timeout, stage=stage)
                except errors.FusedLayerError as e:
                    raise _upload_failed(e, p) from None
            try:
                committed = await self._call(self._stub.CommitWeightSets, pb.CommitWeightSetsRequest(stage=stage),
                                             timeout)
            except errors.FusedLayerError as e:
                raise _commit_failed(e, len(packed), manifest) from None
        except BaseException:
            # Best effort, as in Client.load_weights (also after a cancelled task: the stage holds device
            # memory on the server until it is committed, discarded or abandoned).
            try:
                await self.commit_weight_sets(stage, discard=True, timeout=timeout)
            except errors.FusedLayerError:
                pass
            raise
        return _in_manifest_order(packed, committed)

    async def upload(self, packed: weights.PackedWeightSet, timeout: Optional[float] = None,
                     stage: str = "") -> WeightSetInfo:
        return _weight_set_info(await self._call(self._stub.LoadWeights, _weight_chunks(packed, stage), timeout))

    async def commit_weight_sets(self, stage: str, discard: bool = False,
                                 timeout: Optional[float] = None) -> List[WeightSetInfo]:
        r = await self._call(self._stub.CommitWeightSets, pb.CommitWeightSetsRequest(stage=stage, discard=discard),
                             timeout)
        return [_weight_set_info(w) for w in r.weight_sets]

    async def unload_weight_set(self, name: str, timeout: Optional[float] = None) -> int:
        r = await self._call(self._stub.UnloadWeightSet, pb.UnloadWeightSetRequest(name=name), timeout)
        return int(r.freed_bytes)

    async def list_weight_sets(self, timeout: Optional[float] = None) -> List[WeightSetInfo]:
        r = await self._call(self._stub.ListWeightSets, pb.ListWeightSetsRequest(), timeout)
        return [_weight_set_info(w) for w in r.weight_sets]

    # ---- shared memory regions ---------------------------------------------------------------

    async def register_system_shared_memory(self, name: str, key: str, offset: int, byte_size: int,
                                            timeout: Optional[float] = None) -> None:
        await self._call(self._stub.RegisterSystemSharedMemory, pb.RegisterSystemSharedMemoryRequest(
            name=name, key=key, offset=offset, byte_size=byte_size), timeout)

    async def system_shared_memory_status(self, name: str = "",
                                          timeout: Optional[float] = None) -> List[Dict[str, Any]]:
        r = await self._call(self._stub.SystemSharedMemoryStatus, pb.SystemSharedMemoryStatusRequest(name=name),
                             timeout)
        return [_plain_dict(x) for x in r.regions]

    async def unregister_system_shared_memory(self, name: str = "", timeout: Optional[float] = None) -> int:
        r = await self._call(self._stub.UnregisterSystemSharedMemory,
                             pb.UnregisterSystemSharedMemoryRequest(name=name), timeout)
        return int(r.unregistered)

    async def register_cuda_shared_memory(self, name: str, raw_handle: bytes, device_id: int, offset: int,
                                          byte_size: int, timeout: Optional[float] = None) -> None:
        await self._call(self._stub.RegisterCudaSharedMemory, pb.RegisterCudaSharedMemoryRequest(
            name=name, raw_handle=bytes(raw_handle), device_id=device_id, offset=offset, byte_size=byte_size),
            timeout)

    async def cuda_shared_memory_status(self, name: str = "",
                                        timeout: Optional[float] = None) -> List[Dict[str, Any]]:
        r = await self._call(self._stub.CudaSharedMemoryStatus, pb.CudaSharedMemoryStatusRequest(name=name),
                             timeout)
        return [_plain_dict(x) for x in r.regions]

    async def unregister_cuda_shared_memory(self, name: str = "", timeout: Optional[float] = None) -> int:
        r = await self._call(self._stub.UnregisterCudaSharedMemory, pb.UnregisterCudaSharedMemoryRequest(name=name),
                             timeout)
        return int(r.unregistered)

    # ---- residual sessions -------------------------------------------------------------------

    async def open_residual_session(self, name: str, tokens: int, hc_mult: int, hidden: int,
                                    timeout: Optional[float] = None,
                                    device_id: Optional[int] = None) -> OpenedResidualSession:
        """fusedlayer.Client.open_residual_session as a coroutine (the bytes held, with .device_id)."""
        return _opened_session(await self._call(self._stub.OpenResidualSession,
                                                _open_session_request(name, tokens, hc_mult, hidden, device_id),
                                                timeout))

    async def list_residual_sessions(self, timeout: Optional[float] = None) -> List[Dict[str, Any]]:
        r = await self._call(self._stub.ListResidualSessions, pb.ListResidualSessionsRequest(), timeout)
        return [_plain_dict(s) for s in r.sessions]

    async def close_residual_session(self, name: str = "", timeout: Optional[float] = None) -> int:
        r = await self._call(self._stub.CloseResidualSession, pb.CloseResidualSessionRequest(name=name), timeout)
        return int(r.closed)

    # ---- server ------------------------------------------------------------------------------

    async def server_info(self, timeout: Optional[float] = None) -> ServerInfo:
        return _server_info(await self._call(self._stub.GetServerInfo, pb.GetServerInfoRequest(), timeout))

    async def health(self, service: str = "", timeout: Optional[float] = None) -> str:
        return _health_status(await self._call(self._health_check, health_pb2.HealthCheckRequest(service=service),
                                               timeout))
