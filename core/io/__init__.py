"""Stage 1, readers: dpro run directories (``load``) and foreign traces (``kineto``), validated;
errors name the file."""
