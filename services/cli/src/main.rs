//! `tally` binary: see the library crate.

fn main() -> std::process::ExitCode {
    tally_cli::main()
}
