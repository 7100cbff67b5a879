"""The `smoltorrent` command line: parser, commands, output and reports."""
