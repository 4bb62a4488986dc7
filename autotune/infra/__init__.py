"""What every layer leans on and no layer owns: the clock, files and their modes, bounded input,
logging set-up, secrets hidden, devices named, names loaded on first use, a quick exit."""
