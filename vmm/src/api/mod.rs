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
//!
//! **Descriptors** (`SCM_RIGHTS`): a jailed VMM cannot open the caller's
//! files, so the client sends them. The server keeps the descriptors that
//! come with a connection's bytes, in order (at most 8 wait), and each
//! request that takes one takes the oldest:
//! - `attach_disk` with `"fd":true` (protocol 2; [`Client::attach_disk`]
//!   opens the image and sends it; `path` only names it). A read-write
//!   attachment of a descriptor open read-only, or `fd` with no descriptor,
//!   is `invalid_request`. Snapshots copy a sent disk through its
//!   descriptor, rollbacks put it back by reflinks
//!   (`virtio/blk/inplace.rs`).
//! - `attach_net` (protocol 3): the tap the caller opened in the pod's
//!   namespace (`IFF_TAP|IFF_NO_PI|IFF_VNET_HDR`), checked with `TUNGETIFF`;
//!   refused without a descriptor, without a net device, when a tap is
//!   attached already (one for the VM's life; no detach), or for anything
//!   but such a tap. A VM restored from a snapshot starts detached until its
//!   own `attach_net`; a rollback keeps the tap.
//! - `restore` with `slots` (protocol 3, [`Client::restore_with`]): an image
//!   per `{slot, path}`, attached as it is (the caller put the snapshot's
//!   copy in it). Refused before anything changes: a slot attached in the
//!   snapshot without an image, an image for a slot the VM lacks or empty in
//!   the snapshot, another size than recorded, read-only for a read-write
//!   slot, more entries than descriptors, a slot named twice.
//! - `restore` with `"lazy":true` ([`Client::restore_lazy`]): after the
//!   slot images, an open `/dev/userfaultfd` and a connected Unix stream
//!   socket to the page server ([`crate::uffd`]). Fewer descriptors, one
//!   that makes no userfaultfd, or no stream socket: `invalid_request`
//!   before any VM is touched.
//!
//! [`Client::snapshot`] gives the staging directory to the VMM's user (the
//! owner of its API socket) when that is not the caller's.

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
