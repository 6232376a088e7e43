//! twig-proto: Twig's protocols in one place.
//!
//! - [`agent`] — messages of `agent.proto` (package `twig.agent.v1`, service
//!   `Agent`): the host ↔ guest-agent protocol, spoken over vsock.
//! - [`twig`] — messages of `twig.proto` (package `twig.v1`, services `Twig`
//!   and `Node`): what the controller asks of the shim and the node daemon.
//! - `agent_ttrpc` (feature `sync`) — sync `AgentClient`, `Agent` server
//!   trait and `create_agent`.
//! - `agent_ttrpc_async` (feature `async`) — the same for tokio.
//! - [`node`] — messages of `node.proto` (package `twig.node.v1`, service
//!   `Pool`): what a shim asks of its node daemon (a prepared VMM).
//! - `node_ttrpc` (feature `sync`) — sync `PoolClient` (the shim's).
//! - `node_ttrpc_async` (feature `async`) — async `Pool` server trait and
//!   `create_pool` (the node daemon's).
//! - `twig_ttrpc` (feature `async`) — async `TwigClient`/`NodeClient`,
//!   `Twig`/`Node` server traits, `create_twig`/`create_node`.
//! - [`contract`] — what crosses crates: pod annotations (restore-from,
//!   template, CRI's pod namespace, egress policy), snapshot labels, and
//!   the services' error codes with their meaning.
//! - [`vsock`] — the host side of the Firecracker-style `CONNECT <port>`
//!   handshake on a VMM's vsock Unix socket (async variant with `async`).
//!
//! Without features the crate holds only the messages and the sync vsock
//! client (dependencies: protobuf, thiserror).

/// Messages generated from `agent.proto`.
#[allow(unused, nonstandard_style, missing_docs, clippy::all, clippy::pedantic)]
pub mod agent {
    include!(concat!(env!("OUT_DIR"), "/sync/agent.rs"));
}

/// Messages generated from `twig.proto`.
#[allow(unused, nonstandard_style, missing_docs, clippy::all, clippy::pedantic)]
pub mod twig {
    include!(concat!(env!("OUT_DIR"), "/sync/twig.rs"));
}

/// Messages generated from `node.proto`.
#[allow(unused, nonstandard_style, missing_docs, clippy::all, clippy::pedantic)]
pub mod node {
    include!(concat!(env!("OUT_DIR"), "/sync/node.rs"));
}

/// Sync ttrpc client, server trait and registration helper of service
/// `Pool`.
#[cfg(feature = "sync")]
#[allow(unused, nonstandard_style, missing_docs, clippy::all, clippy::pedantic)]
pub mod node_ttrpc {
    include!(concat!(env!("OUT_DIR"), "/sync/node_ttrpc.rs"));
}

/// Async (tokio) ttrpc client, server trait and registration helper of
/// service `Pool`.
#[cfg(feature = "async")]
#[allow(unused, nonstandard_style, missing_docs, clippy::all, clippy::pedantic)]
pub mod node_ttrpc_async {
    include!(concat!(env!("OUT_DIR"), "/async/node_ttrpc.rs"));
}

/// Sync ttrpc client, server trait and registration helper of service
/// `Agent`.
#[cfg(feature = "sync")]
#[allow(unused, nonstandard_style, missing_docs, clippy::all, clippy::pedantic)]
pub mod agent_ttrpc {
    include!(concat!(env!("OUT_DIR"), "/sync/agent_ttrpc.rs"));
}

/// Async (tokio) ttrpc client, server trait and registration helper of
/// service `Agent`.
#[cfg(feature = "async")]
#[allow(unused, nonstandard_style, missing_docs, clippy::all, clippy::pedantic)]
pub mod agent_ttrpc_async {
    include!(concat!(env!("OUT_DIR"), "/async/agent_ttrpc.rs"));
}

/// Async (tokio) ttrpc clients, server traits and registration helpers of
/// services `Twig` and `Node`.
#[cfg(feature = "async")]
#[allow(unused, nonstandard_style, missing_docs, clippy::all, clippy::pedantic)]
pub mod twig_ttrpc {
    include!(concat!(env!("OUT_DIR"), "/async/twig_ttrpc.rs"));
}

pub mod contract;
pub mod vsock;

/// The vsock port the guest agent listens on.
pub const AGENT_VSOCK_PORT: u32 = 1024;

/// Where the guest agent keeps guest volumes (PrepareVolume): volume
/// `<name>` is the directory `<GUEST_VOLUMES_DIR>/<name>` in the VM, on a
/// tmpfs of the agent's (root only), or a tmpfs of its own. A container
/// gets a volume, or one file of it, by a bind mount whose source in its
/// OCI spec is `<GUEST_VOLUMES_DIR>/<name>[/<path>]`.
pub const GUEST_VOLUMES_DIR: &str = "/run/twig/volumes";
