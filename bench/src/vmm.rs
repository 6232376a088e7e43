//! Benchmarks of twig-vmm.

pub type Error = Box<dyn std::error::Error>;

#[derive(clap::Args)]
pub struct Args {}

pub fn run(_args: &Args) -> Result<serde_json::Value, Error> {
    Err("the vmm benchmark is not written yet".into())
}
