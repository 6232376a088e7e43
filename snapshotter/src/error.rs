//! Errors of both stores: twig-store's, which the image store shares. Each
//! maps to one containerd errdefs class so the gRPC layer can answer with
//! the code containerd expects.

pub use twig_store::error::{ctx, Error, Result};
