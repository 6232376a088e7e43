//! The API of the `twig-vmm` binary: one VM per process, line-delimited JSON
//! on a Unix socket, one [`Request`] per line, one [`Response`] per line.
//! [`Client`] is its typed client (used by the shim, the bench and the
//! tests); [`Server`] serves it (`twig-vmm serve`).
//!
//! ```text
//! → {"op":"hello"}
//! ← {"ok":{"hello":{"protocol":3,"version":"0.1.0"}}}
//! → {"op":"boot","kernel":"/path/vmlinux","initrd":"/path/initrd","cmdline":"console=ttyS0","mem_mib":128,"vcpus":1}
//! ← {"ok":{"state":{"state":"running"}}}
//! → {"op":"restore","dir":"/store/snapshots/a"}    ← {"ok":{"restored":{"id":"…"}}}
//! → {"op":"pause"}  {"op":"resume"}                ← {"ok":{"state":{"state":"paused"}}}
//! → {"op":"snapshot","dir":"/store/tmp/<lease>/b","kind":"incremental"}
//! ← {"ok":{"snapshot":{"id":"…","kind":"incremental","parent":"…",…}}}
//! → {"op":"rollback","dir":"/store/snapshots/a"}   ← {"ok":{"rollback":{…}}}
//! → {"op":"stats"}                                 ← {"ok":{"stats":{…}}}
//! → {"op":"attach_disk","slot":0,"path":"/d.img","read_only":false}
//! ← {"error":{"kind":"invalid_request","message":"… has no disk slots …"}}
//! → {"op":"shutdown"}                              ← {"ok":{"shut_down":{}}}
//! ```
//!
//! **Errors** are `{"error":{"kind":K,"message":M}}`, `K` an [`ErrorKind`]:
//! `invalid_request` (bad JSON, bad arguments, wrong state; nothing changed),
//! `refused` (the operation failed, the VM still runs on its previous
//! state), `not_found` (the snapshot does not exist), `guest_not_answering`,
//! `guest_stopped`, `lost` (replace the VM), `busy` (too many connections)
//! and `internal`. [`Error::kind`](crate::Error::kind) is the one mapping
//! from the VMM's errors.
//!
//! **Versions**: `hello` answers [`PROTOCOL_VERSION`]; [`Client::connect`]
//! refuses a VMM that speaks another one.
//!
//! **Concurrency and deadlines**: every connection has its own thread, up
//! to [`Limits::max_connections`] (one more gets a `busy` error and is
//! closed). Requests serialize on the VM's mutex; reading a request and
//! writing its answer happen outside it, so an idle, slow or vanished
//! client blocks no one. A connection with no complete request for
//! [`Limits::idle_timeout`] is closed. A client gone mid-request does not
//! stop the operation; its answer is dropped. Each [`Client`] call has its
//! own deadline.
//!
//! The VM gets the devices the server was started with (`--disk`, `--tap`,
//! `--vsock-uds`), whether it boots or restores; a restored VM's
//! read-write disk files get the snapshot's disk contents.

mod client;
mod server;
mod types;

pub use client::{Client, ClientError};
pub use server::{bind, Limits, SerialFactory, Server};
pub use types::{
    ApiError, Hello, Reply, Request, Response, RestoreSlot, MAX_REQUEST, MAX_RESPONSE,
    PROTOCOL_VERSION,
};

pub use crate::error::ErrorKind;
