//! `tally-broker` binary: see the library crate.

fn main() -> std::process::ExitCode {
    tally_shared::service::service_main("tally-broker", tally_broker::run)
}
