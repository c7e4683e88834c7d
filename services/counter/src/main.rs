//! `tally-counter` binary: see the library crate.

fn main() -> std::process::ExitCode {
    tally_shared::service::service_main("tally-counter", tally_counter::run)
}
