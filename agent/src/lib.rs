//! twig-agent: the guest side of Twig's host↔guest protocol.
//!
//! The library half holds what the host needs: with feature `client`, a
//! synchronous client ([`client::AgentClient`]) that reaches the agent
//! through a VMM's vsock Unix socket or a plain Unix socket, and,
//! re-exported from twig-proto, the generated protocol code ([`proto`]).
//! With feature `caps`, [`caps`] sets a process's capability sets as runc
//! does. With feature `testkit` it also holds [`testkit`] (busybox rootfs images
//! and OCI specs for tests). The agent itself (PID 1 in the guest) is the
//! `twig-agent` binary (feature `server`, on by default), which links no
//! client: `default-features = false, features = ["client"]` gives just the
//! client.

/// The generated protocol code (`twig_proto`): `proto::agent` (messages),
/// `proto::agent_ttrpc` (sync client, server trait), `proto::vsock`.
pub use twig_proto as proto;

#[cfg(feature = "caps")]
pub mod caps;
#[cfg(feature = "client")]
pub mod client;
#[cfg(feature = "testkit")]
pub mod testkit;

pub use twig_proto::AGENT_VSOCK_PORT;
